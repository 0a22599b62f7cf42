import pytest

from examples import benchmark_decode


def test_benchmark_prints_kvfn_and_mlx_lm_side_by_side(capsys, tmp_path):
    result = benchmark_decode.main(["--shape", "tiny", "--lengths", "96", "--budgets", "48",
                                    "--chunks", "32", "--steps", "2",
                                    "--json", str(tmp_path / "b.json")])  # fmt: skip
    (pre,) = result["prefill"]
    assert pre["L"] == 96 and pre["chunk"] == 32
    assert pre["time_ratio"] == pytest.approx(pre["kvfn_s"] / pre["mlx_s"])
    assert pre["expected_s"] > 0 and pre["expected_gb"] > 0  # Expected Attention's prefill
    assert pre["kvzip_s"] > 0 and pre["kvzip_gb"] > 0  # KVzip's: the prefill and its own pass
    (ev,) = result["evict"]
    assert ev["traced_ms"] > 0 and ev["eager_ms"] > 0
    (row,) = result["decode"]
    assert row["L"] == 96 and row["R"] == 48
    assert row["kvfn_R_vs_mlx_R"] == pytest.approx(row["kvfn_R_ms"] / row["mlx_R_ms"])
    assert row["speedup_kvfn"] == pytest.approx(row["mlx_full_ms"] / row["kvfn_R_ms"])
    # 8 layers x 4 KV heads x (2 x 64 float32 + an int32 position) bytes a row
    per_row = 8 * 4 * (2 * 64 * 4 + 4)
    assert row["kept_kv_mb"] * 1e6 == pytest.approx(48 * per_row)
    assert row["full_kv_mb"] * 1e6 == pytest.approx(95 * per_row)
    w = result["weights_gb"] * 1e3
    assert row["byte_bound"] == pytest.approx((w + row["full_kv_mb"]) / (w + row["kept_kv_mb"]))
    out = capsys.readouterr().out
    assert "kvfn R / mlx R" in out and "memory ratio" in out and "kvfn expected" in out and "compiled compact_states" in out
    assert (tmp_path / "b.json").stat().st_size > 100


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--budgets", "8"], "--budgets: values must be >= 40, got [8]"),
        (["--q4"], "--q4: needs --shape"),
        (["--shape", "huge"], "invalid choice: 'huge'"),
    ],
)
def test_benchmark_rejects_bad_values(argv, message, capsys):
    with pytest.raises(SystemExit):
        benchmark_decode.main(argv)
    assert message in capsys.readouterr().err
