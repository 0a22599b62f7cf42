import pytest

from examples import benchmark_decode


def test_benchmark_runs_side_by_side(capsys, tmp_path):
    png = tmp_path / "bench.png"
    result = benchmark_decode.main(["--lengths", "96", "--budgets", "48", "--steps", "2",
                                    "--plot", str(png)])  # fmt: skip
    (row,) = result["decode"]
    assert row["L"] == 96 and row["R"] == 48
    assert all(
        row[k] > 0 for k in ("compacted_ms", "plain_R_ms", "mlx_R_ms", "full_ms", "mlx_full_ms")
    )
    (pre,) = result["prefill"]
    assert pre["plain_s"] > 0 and pre["scored_s"] > 0
    # 30 layers x 3 KV heads x (2 x 64 float32 + an int32 position) bytes a row
    per_row = 30 * 3 * (2 * 64 * 4 + 4)
    assert row["kept_kv_mb"] * 1e6 == pytest.approx(48 * per_row)
    assert row["full_kv_mb"] * 1e6 == pytest.approx(95 * per_row)
    w = row["weights_mb"]
    assert row["byte_bound"] == pytest.approx((w + row["full_kv_mb"]) / (w + row["kept_kv_mb"]))
    assert row["compacted_peak_mb"] > w and row["full_peak_mb"] > w
    assert png.read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert "compacted/plain-R" in out and "byte bound" in out


def test_benchmark_rejects_bad_values(capsys):
    with pytest.raises(SystemExit):
        benchmark_decode.main(["--budgets", "8"])
    assert "--budgets: values must be >= 40" in capsys.readouterr().err
