import pytest

from examples import benchmark_decode


def test_benchmark_runs_side_by_side(capsys):
    result = benchmark_decode.main(["--lengths", "96", "--budgets", "48", "--steps", "2"])
    (row,) = result["decode"]
    assert row["L"] == 96 and row["R"] == 48
    assert all(
        row[k] > 0 for k in ("compacted_ms", "plain_R_ms", "mlx_R_ms", "full_ms", "mlx_full_ms")
    )
    (pre,) = result["prefill"]
    assert pre["plain_s"] > 0 and pre["scored_s"] > 0
    assert "compacted/plain-R" in capsys.readouterr().out


def test_benchmark_rejects_bad_values(capsys):
    with pytest.raises(SystemExit):
        benchmark_decode.main(["--budgets", "8"])
    assert "--budgets: values must be >= 40" in capsys.readouterr().err
