"""Summaries, intervals, paired differences, tables and plots from hand-made records."""

import json
from pathlib import Path

import numpy as np
import pytest

from kvfn_eval.report import (
    differences,
    leaders,
    main,
    markdown,
    markdown_budget,
    markdown_differences,
    markdown_leaders,
    markdown_needles,
    markdown_pairs,
    plot,
    styles,
    summarize,
)


def rec(task, method, budget, score, frac, kept=None, mode="aware", tokens=1000, seed=None):
    return dict(mode=mode, target_tokens=tokens, task=task, method=method, budget=budget,
                score=score, kv_fraction=frac, needle_kept=kept, seed=seed)  # fmt: skip


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
    assert lines[2] == "| tokens | method | samples | all rows | 128 |"
    # common_words has one sample (a record without a seed is a sample of its own): the
    # average (3 samples: passkey's 2 and that one) has no interval
    assert "| 1000 | full | 3 | 50.0 (100%) |  |" in lines
    assert "| 1000 | snapkv | 3 |  | 62.5 (14%) |" in lines
    passkey = {(r["method"]): r for r in summarize(RECORDS) if r["task"] == "passkey"}
    full = passkey["full"]  # two samples, 1 and 0
    assert full["samples"] == 2 and full["lo"] == 0.0 and full["hi"] == 100.0
    assert f"| 1000 | full | 2 | 50.0 [{full['lo']:.1f}, {full['hi']:.1f}] (100%) |  |" in (
        markdown(summarize(RECORDS), task="passkey").splitlines()
    )


def samples(n, p, questions=2, method="snapkv", task="passkey", seed0=0, budget=128, rng=None):
    """``n`` samples of ``questions`` answers each, every answer right with probability p."""
    rng = rng or np.random.default_rng(seed0)
    return [rec(task, method, budget, float(rng.random() < p), 0.1, seed=seed0 + i)
            for i in range(n) for _ in range(questions)]  # fmt: skip


def cell(summary, task="passkey", method="snapkv", budget=128):
    (row,) = [r for r in summary if (r["task"], r["method"], r["budget"]) == (task, method, budget)]
    return row


def test_intervals_cover_the_mean_and_shrink_with_more_samples():
    widths = []
    for n in (5, 20, 80):
        records = samples(n, 0.6) + samples(n, 0.3, task="niah_single", seed0=1000)
        summary = summarize(records)
        for task in ("passkey", "niah_single", "average"):
            row = cell(summary, task)
            assert row["lo"] <= row["score"] <= row["hi"]
        row = cell(summary, "average")
        assert row["samples"] == 2 * n and row["n"] == 4 * n
        widths.append(row["hi"] - row["lo"])
    assert widths[0] > widths[1] > widths[2] > 0


def test_intervals_resample_samples_not_answers():
    # 10 samples of 10 answers, each sample all right or all wrong: as uncertain as 10 coin
    # flips (a 95% interval about 60 points wide), not as 100 (about 20)
    records = [rec("passkey", "snapkv", 128, float(i % 2), 0.1, seed=i)
               for i in range(10) for _ in range(10)]  # fmt: skip
    row = cell(summarize(records))
    assert row["score"] == 50.0 and row["samples"] == 10 and row["n"] == 100
    assert row["hi"] - row["lo"] > 40


def test_intervals_are_deterministic_under_the_seed_and_per_cell():
    records = samples(12, 0.5) + samples(12, 0.5, method="streaming", seed0=0)
    first, again = summarize(records, seed=3), summarize(records, seed=3)
    assert first == again
    other = summarize(records, seed=4)
    assert [(r["lo"], r["hi"]) for r in other] != [(r["lo"], r["hi"]) for r in first]
    # a cell's draws do not depend on the other methods in the records
    alone = summarize(samples(12, 0.5), seed=3)
    assert (cell(alone)["lo"], cell(alone)["hi"]) == (cell(first)["lo"], cell(first)["hi"])
    assert differences(records, seed=3) == differences(records, seed=3)


def test_a_method_against_itself_differs_by_exactly_zero():
    records = samples(8, 0.5) + samples(8, 0.4, task="niah_single", seed0=50)
    for row in differences(records, references=["snapkv"]):
        assert row["method"] == "snapkv" and row["reference"] == "snapkv"
        assert (row["difference"], row["lo"], row["hi"]) == (0.0, 0.0, 0.0)
    assert {r["task"] for r in differences(records)} == {"passkey", "niah_single", "average"}


def test_a_method_always_one_point_better_differs_by_one_with_no_spread():
    rng = np.random.default_rng(0)
    ref = [rec(t, "snapkv", 128, float(rng.integers(0, 99)) / 100, 0.1, seed=s)
           for t in ("passkey", "niah_single") for s in range(6) for _ in range(2)]  # fmt: skip
    better = [{**r, "method": "chunkkv", "score": r["score"] + 0.01} for r in ref]
    other_budget = [{**r, "method": "chunkkv", "budget": 256} for r in ref]
    rows = differences(ref + better + other_budget, references=["snapkv", "streaming"])
    chunkkv = [r for r in rows if r["method"] == "chunkkv"]
    got = {(r["task"], r["budget"], r["reference"]) for r in chunkkv}
    # no streaming records; no snapkv at 256
    assert got == {(t, 128, "snapkv") for t in ("passkey", "niah_single", "average")}
    for row in chunkkv:
        assert row["difference"] == pytest.approx(1.0, abs=1e-9)
        assert row["lo"] == pytest.approx(1.0, abs=1e-9)
        assert row["hi"] == pytest.approx(1.0, abs=1e-9)
    unpaired = cell(summarize(ref + better), method="chunkkv")
    assert unpaired["hi"] - unpaired["lo"] > 20  # the samples' own spread, paired away
    table = markdown_differences(rows).splitlines()
    assert table[0] == "**average, query-aware: points over snapkv, paired by sample**"
    assert table[2] == "| tokens | method | samples | 128 |"
    assert table[4:] == ["| 1000 | chunkkv | 12 | +1.0 [+1.0, +1.0] |"]  # 6 a task; not snapkv


def test_the_leader_answers_most_and_leads_the_second_on_paired_samples():
    rng = np.random.default_rng(1)
    ref = [rec(t, "snapkv", 128, float(rng.integers(0, 99)) / 100, 0.1, seed=s)
           for t in ("passkey", "niah_single") for s in range(6) for _ in range(2)]  # fmt: skip
    better = [{**r, "method": "chunkkv", "score": r["score"] + 0.01} for r in ref]
    worse = [{**r, "method": "streaming", "score": r["score"] - 0.3} for r in ref]
    alone = [{**r, "method": "chunkkv", "budget": 256} for r in ref]
    full = [{**r, "method": "full", "budget": None, "score": 1.0} for r in ref]
    rows = {r["budget"]: r for r in leaders(ref + better + worse + alone + full)}
    assert set(rows) == {128, 256}  # the full cache keeps every row: no budget, no contest
    row = rows[128]
    summary = {r["method"]: r for r in summarize(ref + better) if r["task"] == "average"}
    assert (row["method"], row["second"]) == ("chunkkv", "snapkv")
    assert row["score"] == pytest.approx(summary["chunkkv"]["score"])
    assert row["second_score"] == pytest.approx(summary["snapkv"]["score"])
    assert row["lo"] == summary["chunkkv"]["lo"] and row["hi"] == summary["chunkkv"]["hi"]
    for key in ("difference", "difference_lo", "difference_hi"):
        assert row[key] == pytest.approx(1.0, abs=1e-9)  # paired: one point, no spread
    assert rows[256]["method"] == "chunkkv" and rows[256]["second"] is None
    assert rows[256]["difference"] is None
    table = markdown_leaders(list(rows.values())).splitlines()
    assert table[2] == "| tokens | 128 | 256 |"
    top, lone = summary["chunkkv"], cell(summarize(alone), "average", "chunkkv", 256)
    assert table[4] == (f"| 1000 | chunkkv {top['score']:.1f} [{top['lo']:.1f}, {top['hi']:.1f}]"
                        f", +1.0 [+1.0, +1.0] over snapkv | chunkkv {lone['score']:.1f} "
                        f"[{lone['lo']:.1f}, {lone['hi']:.1f}] |")  # fmt: skip


def test_a_tie_goes_to_the_first_name_and_leads_by_zero():
    ref = samples(6, 0.5)
    rows = leaders(ref + [{**r, "method": "adakv"} for r in ref])
    assert [(r["method"], r["second"], r["difference"]) for r in rows] == [("adakv", "snapkv", 0)]
    assert ", tied with snapkv (+0.0 [+0.0, +0.0])" in markdown_leaders(rows)


def test_one_budget_across_lengths_and_chosen_pairs(tmp_path, capsys):
    records = [
        *samples(6, 0.5, method="snapkv", budget=0.125),
        *samples(6, 0.9, method="chunkkv", budget=0.125),
        *samples(6, 0.2, method="snapkv", budget=0.25),
        *[{**r, "target_tokens": 4096} for r in samples(4, 0.7, method="snapkv", budget=0.125)],
        *samples(6, 1.0, method="full", budget=None),
    ]
    summary = summarize(records)
    table = markdown_budget(summary, 0.125).splitlines()
    short = [r for r in summary if r["target_tokens"] == 1000]
    snap, chunk = (cell(short, "average", m, 0.125) for m in ("snapkv", "chunkkv"))
    full = cell(short, "average", "full", None)
    assert table[0] == "| mode, tokens (full) | chunkkv | snapkv |"  # the best first

    def two(row):  # "score [lo, hi]", two significant figures at most
        a, b, c = (f"{v:.0f}" if abs(v) >= 9.95 else f"{v:.1f}"
                   for v in (row["score"], row["lo"], row["hi"]))  # fmt: skip
        return f"{a} [{b}, {c}]"

    assert snap["lo"] < 9.95 <= snap["hi"]  # both forms: one decimal below 10, none above
    assert table[2] == f"| aware, 1000 ({two(full)}) | **{two(chunk)}** | {two(snap)} |"
    long = cell([r for r in summary if r["target_tokens"] == 4096], "average", "snapkv", 0.125)
    assert table[3] == f"| aware, 4K |  | **{two(long)}** |"  # no full cache, no chunkkv there
    pair = [("aware", "chunkkv", 0.125, "snapkv")]
    rows = markdown_pairs(differences(records), pair).splitlines()
    assert rows[:2] == ["| mode, policy, budget, from | 1000 | 4K |", "|---|---|---|"]
    assert (
        rows[2].startswith("| aware, chunkkv, 12.5%, from snapkv | +") and rows[2][-5:] == " |  |"
    )
    with pytest.raises(ValueError, match="no paired difference for chunkkv from snapkv at 25%"):
        markdown_pairs(differences(records), [("aware", "chunkkv", 0.25, "snapkv")])
    path = tmp_path / "run.json"
    path.write_text(json.dumps(dict(records=records)))
    main([str(path), "--budget", "0.125", "--pair", "aware:chunkkv:0.125:snapkv", "--leaders"])
    out = capsys.readouterr().out
    assert "\n".join(table) in out and "\n".join(rows) in out and "who answers most" in out
    for argv, error in [(["--budget", "0.5"], "no method ran at 0.5"),
                        (["--pair", "aware:chunkkv:0.125"], "expected MODE:METHOD:BUDGET:FROM"),
                        (["--pair", "aware:kvzip:0.125:snapkv"], "no paired difference for kvzip")]:  # fmt: skip
        with pytest.raises(SystemExit):
            main([str(path), *argv])
        assert error in capsys.readouterr().err
    main([str(path)])  # nothing asked: who answers most
    assert capsys.readouterr().out.startswith("**who answers most, query-aware")
    with pytest.raises(SystemExit):
        main([str(tmp_path / "missing.json")])
    assert "is not a result evaluate.py wrote" in capsys.readouterr().err


def test_the_needle_table_shows_the_layers_that_keep_least_and_most(tmp_path, capsys):
    """Per (length, method): the mean score, the needle rows' mean share, the means of each
    answer's least and most layer shares, and the layer that keeps most most often; records
    without per-layer shares (other budgets, modes, tasks without needles) are left out."""

    def layered(method, score, layers, budget=0.25, mode="agnostic"):
        r = rec("niah", method, budget, score, budget, float(np.mean(layers)), mode=mode)
        return {**r, "needle_kept_layers": layers}

    records = [
        layered("adakvzip", 0.0, [0.9, 0.1, 0.8]),
        layered("adakvzip", 1.0, [0.9, 0.5, 0.2]),
        layered("adakvzip", 0.0, [0.7, 0.0, 0.8]),
        layered("adakvzip-global", 1.0, [0.6, 0.4, 0.5]),
        layered("adakvzip-global", 1.0, [0.0, 0.9, 0.9], budget=0.125),
        layered("adakvzip-global", 0.0, [0.0, 0.9, 0.9], mode="aware"),
        rec("common_words", "adakvzip", 0.25, 1.0, 0.25, mode="agnostic"),
    ]
    lines = markdown_needles(records, "agnostic", 0.25).splitlines()
    assert lines[2:] == [
        "| 1000 | adakvzip | 3 | 33.3 | 0.544 | 0.100 | 0.867 | 0 |",
        "| 1000 | adakvzip-global | 1 | 100.0 | 0.500 | 0.400 | 0.600 | 0 |",
    ]
    with pytest.raises(ValueError, match="no records with needle_kept_layers at 6.25%"):
        markdown_needles(records, "agnostic", 0.0625)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(dict(records=records)))
    main([str(path), "--needles", "agnostic:0.25"])
    assert capsys.readouterr().out.strip() == "\n".join(lines)
    with pytest.raises(SystemExit):
        main([str(path), "--needles", "agnostic:0.5"])
    assert "argument --needles: expected MODE:BUDGET" in capsys.readouterr().err


def test_records_without_a_seed_pair_by_their_order():
    ref = [rec("passkey", "snapkv", 128, s, 0.1) for s in (0.0, 1.0, 0.0, 1.0)]
    same = [{**r, "method": "chunkkv"} for r in ref]
    flipped = [{**r, "method": "expected", "score": 1.0 - r["score"]} for r in ref]
    rows = {r["method"]: r for r in differences(ref + same + flipped, references=["snapkv"])
            if r["task"] == "passkey"}  # fmt: skip
    same_row = rows["chunkkv"]
    assert (same_row["difference"], same_row["lo"], same_row["hi"]) == (0.0, 0.0, 0.0)
    assert rows["expected"]["difference"] == 0.0 and rows["expected"]["hi"] == 100.0
    assert rows["expected"]["samples"] == 4


def test_the_qwen_4k_records_still_summarize():
    path = Path(__file__).parents[1] / "examples/results/qwen05-4k.json"
    saved = json.loads(path.read_text())
    summary = summarize(saved["records"])
    key = ("mode", "target_tokens", "task", "method", "budget")
    old = {tuple(r[k] for k in key): r["score"] for r in saved["summary"]}
    assert {tuple(r[k] for k in key): r["score"] for r in summary} == pytest.approx(old)
    assert all(r["lo"] is None for r in summary)  # one sample a task: no interval
    diffs = differences(saved["records"])
    policies = {r["method"] for r in saved["records"] if r["budget"] is not None}
    for mode in ("aware", "agnostic"):
        for budget in (256, 512, 1024):
            got = {(r["method"], r["reference"]) for r in diffs
                   if (r["mode"], r["budget"], r["task"]) == (mode, budget, "average")}  # fmt: skip
            assert got == {(m, ref) for m in policies for ref in ("snapkv", "streaming")}


def test_plot_writes_one_png_per_mode_and_length(tmp_path):
    records = RECORDS + [rec("passkey", "kv4", None, 1.0, 0.28, 1.0, mode="agnostic")]
    files = plot(summarize(records), str(tmp_path / "run"))
    assert sorted(f.rsplit("/", 1)[1] for f in files) == ["run-agnostic-1000.png",
                                                        "run-aware-1000.png"]  # fmt: skip
    for f in files:
        assert open(f, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_every_method_has_its_own_style():
    """Twelve methods (the registry's): no two share a line's look (matplotlib's default cycle
    repeats after ten)."""
    assert len(set(styles([f"m{i}" for i in range(12)]).values())) == 12
