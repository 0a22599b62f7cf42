"""examples/benchmark_reuse.py --task: the evaluation's contexts through kvfn-server's reused
compacted context and through mlx-lm's own prompt cache, scored as the evaluation scores."""

import json

import pytest

from examples import benchmark_reuse


def test_the_evaluations_contexts_are_reused_and_scored_by_its_scorer(capsys, tmp_path):
    from kvfn_eval import answers

    out = tmp_path / "reuse.json"
    result = benchmark_reuse.main([
        "--task", "niah_multikey", "--tokens", "640", "--contexts", "2", "--questions", "3",
        "--policy", "streaming", "--budget", "0.125", "--prefill-step-size", "256",
        "--no-warm-up", "--out", str(out), "--log", str(tmp_path / "servers.log"),
    ])  # fmt: skip
    turns = result["turns"]
    assert json.loads(out.read_text())["turns"] == turns  # every turn, as written
    keys = {(t["server"], t["context"], t["question"]) for t in turns}
    assert len(turns) == 12 and keys == {(s, c, q) for s in ("streaming", "none")
                                         for c in range(2) for q in range(3)}  # fmt: skip
    for t in turns:
        assert t["score"] == answers.match_all(t["answer"], t["references"])
        assert 0 <= t["score"] <= 1 and t["prompt_tokens"] == t["local_tokens"]
        assert t["context_tokens"] >= t["head_tokens"] - 2 > 500
        assert t["prompt_tokens"] + result["config"]["max_tokens"] <= 640  # the answer fits too
    for t in (t for t in turns if t["server"] == "streaming"):
        assert t["rows"] == round(0.125 * t["head_tokens"])
        if t["question"] == 0:  # compacts the context and keeps it
            assert t["reused"] is False and t["cached_tokens"] == 0
        else:  # prefills only the question over the kept context
            assert t["reused"] is True and t["cached_tokens"] == t["context_tokens"] - 1
    for t in (t for t in turns if t["server"] == "none"):
        assert t["kv_eviction"] is None and t["reused"] is None and t["kv_fraction"] == 1.0
        if t["question"]:  # mlx-lm's lossless cache: the context and the question's start
            assert t["cached_tokens"] >= t["context_tokens"]
    last = {h["server"]: h for h in result["metrics"] if h["context"] == 1}
    assert last["none"]["compacted_requests"] == last["none"]["compacted_contexts"] == 0
    assert last["none"]["prompt_cache_sequences"] == 3  # an entry a question (size 3)
    assert last["streaming"]["compacted_contexts"] == 1  # --prompt-cache-size 1
    assert last["streaming"]["compacted_requests"] == 2  # once a context
    rows = {r["server"]: r for r in result["summary"]}
    assert rows["none"]["q1_s"] == rows["none"]["full_prefill_s"]
    for name, r in rows.items():
        mine = [t for t in turns if t["server"] == name]
        assert r["contexts"] == 2 and r["answers"] == 6
        assert r["accuracy"] == pytest.approx(100 * sum(t["score"] for t in mine) / 6)
        assert 0 <= r["accuracy"] <= 100 and r["lo"] <= r["accuracy"] <= r["hi"]
    assert rows["streaming"]["reused"] == rows["streaming"]["later_turns"] == 4
    assert rows["streaming"]["prompt_cache_mb"] < rows["none"]["prompt_cache_mb"] / 3
    printed = capsys.readouterr().out
    assert "q2-N / full prefill" in printed and "\nstreaming " in printed and "\nnone " in printed


def test_the_grids_row_for_a_policy_budget_and_length():
    rows = benchmark_reuse.grid_rows("examples/results/qwen05-gpu.json.gz", "adakvzip-global",
                                     0.125, 8192, "niah_multikey")  # fmt: skip
    assert {(r["method"], r["budget"]) for r in rows} == {
        ("adakvzip-global", 0.125),
        ("full", None),
    }
    assert all(r["samples"] >= 2 and r["lo"] <= r["score"] <= r["hi"] for r in rows)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--questions", "1"], "argument --questions: at least 2"),
        (["--task", "nope"], "invalid choice: 'nope'"),
        (["--task", "passkey", "--questions", "3"], "passkey asks 1 question(s) of a context"),
        (["--budget", "20"], "20 rows is below the server's sink tokens + window"),
        (["--budget", "1.5"], "a fraction in (0, 1) or a whole number of rows, got '1.5'"),
        (["--policy", "snapkv"], "'snapkv' is not query-agnostic"),
        (["--policy", "nope"], "argument --policy: "),
        (["--tokens", "300", "--budget", "40"], "40 rows a context, fewer than the"),
        (["--tokens", "300", "--budget", "1000"], "1000 rows keep the whole"),
        (["--model", "/nonexistent/m.gguf"], "argument --model: "),
    ],
)
def test_bad_values_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        benchmark_reuse.main(["--task", "niah_multikey", "--questions", "3", *argv])
    assert message in capsys.readouterr().err


def test_a_fraction_needs_the_evaluations_contexts(capsys):
    with pytest.raises(SystemExit):
        benchmark_reuse.main(["--budget", "0.25"])
    assert "argument --budget: a fraction (0.25) needs --task" in capsys.readouterr().err
