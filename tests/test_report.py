"""Summaries, tables and plots from hand-made records."""

from kvfn_eval.report import markdown, plot, summarize


def rec(task, method, budget, score, frac, kept=None, mode="aware", tokens=1000):
    return dict(mode=mode, target_tokens=tokens, task=task, method=method, budget=budget,
                score=score, kv_fraction=frac, needle_kept=kept)  # fmt: skip


RECORDS = [
    rec("passkey", "full", None, 1.0, 1.0, 1.0),
    rec("passkey", "full", None, 0.0, 1.0, 1.0),
    rec("passkey", "snapkv", 128, 1.0, 0.13, 0.5),
    rec("passkey", "snapkv", 128, 1.0, 0.15, 0.7),
    rec("common_words", "full", None, 0.5, 1.0),
    rec("common_words", "snapkv", 128, 0.25, 0.14),
]


def test_summary_means_per_group_and_the_task_average():
    rows = {(r["task"], r["method"], r["budget"]): r for r in summarize(RECORDS)}
    assert rows[("passkey", "full", None)]["score"] == 50.0
    assert rows[("passkey", "snapkv", 128)]["kv_fraction"] == 0.14
    assert abs(rows[("passkey", "snapkv", 128)]["needle_kept"] - 0.6) < 1e-12
    assert rows[("common_words", "snapkv", 128)]["needle_kept"] is None
    assert rows[("average", "full", None)]["score"] == 50.0  # (50 + 50) / 2
    assert rows[("average", "snapkv", 128)]["score"] == 62.5  # (100 + 25) / 2, per task first
    assert rows[("average", "snapkv", 128)]["n"] == 3


def test_markdown_puts_methods_in_rows_and_budgets_in_columns():
    table = markdown(summarize(RECORDS))
    lines = table.splitlines()
    assert lines[0] == "**average, query-aware**"
    assert lines[2] == "| tokens | method | all rows | 128 |"
    assert "| 1000 | full | 50.0 (100%) |  |" in lines
    assert "| 1000 | snapkv |  | 62.5 (14%) |" in lines
    assert "| 1000 | snapkv |  | 100.0 (14%) |" in markdown(summarize(RECORDS), task="passkey")


def test_plot_writes_one_png_per_mode_and_length(tmp_path):
    records = RECORDS + [rec("passkey", "kv4", None, 1.0, 0.28, 1.0, mode="agnostic")]
    files = plot(summarize(records), str(tmp_path / "run"))
    assert sorted(f.rsplit("/", 1)[1] for f in files) == ["run-agnostic-1000.png",
                                                        "run-aware-1000.png"]  # fmt: skip
    for f in files:
        assert open(f, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
