"""The evaluator on SmolLM2: prompts, equal-memory accounting, reuse, and the example script."""

import gzip
import json
import re
import time

import mlx.core as mx
import numpy as np
import pytest

import kvfn
from examples import evaluate as evaluate_example
from kvfn import SnapKV
from kvfn_eval import report, tasks
from kvfn_eval.evaluator import (
    Evaluator,
    Method,
    prompt_tokens,
    quantized_row_fraction,
    rows_for,
    token_counter,
)
from kvfn_eval.memory import reset_peak


@pytest.fixture(scope="module")
def sample(smollm2):
    _, tokenizer = smollm2
    return tasks.generate("niah_multikey", seed=0, target_tokens=300,
                          count_tokens=token_counter(tokenizer), n_questions=2)  # fmt: skip


def test_method_names_round_trip_and_bad_names_are_named():
    for name in ["full", "snapkv", "streaming", "random", "kv8", "kv4", "snapkv+kv4"]:
        assert Method.parse(name).name == name
    assert Method.parse("snapkv+kv4") == Method("snapkv", 4)
    m = Method.parse("snapkv-k31-avg-layer+kv8")
    assert m.name == "snapkv-k31-avg-layer+kv8" and m.kv_bits == 8
    assert m.make_policy(64, window=16) == SnapKV(budget=64, window=16, kernel_size=31,
                                                  pooling="avg", per_head=False)  # fmt: skip
    for bad in ["snap", "kv5", "full+kv4", "snapkv+random", "snapkv-k", "snapkv-k8", "snapkv-w9",
                "streaming-layer"]:  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(f"unknown method '{bad}'")):
            Method.parse(bad)


def test_equal_memory_rows_for_quantized_eviction():
    # 4 bits + a float16 scale and bias per 64 values: 36 of 128 bytes per 64-value row
    assert quantized_row_fraction(64, 2, 4) == 36 / 128
    assert rows_for(Method("snapkv", 4), 256, 64, 2) == int(256 * 128 / 36)
    assert rows_for(Method("snapkv"), 256, 64, 2) == 256
    assert rows_for(Method(None, 8), 256, 64, 2) is None


def test_prompt_shares_the_context_and_finds_the_needles(smollm2, sample):
    _, tokenizer = smollm2
    a, b = (prompt_tokens(tokenizer, sample, q) for q in sample.questions)
    assert a.head == b.head and a.tail != b.tail
    assert len(a.head) + len(a.tail) <= 300
    text = tokenizer.decode(a.head + a.tail)
    assert sample.context in text and text.endswith(sample.questions[0].answer_prefix)
    for needle, q in zip(a.needles, sample.questions):
        assert q.answers[0] in tokenizer.decode([a.head[i] for i in needle])


def test_evaluator_accounts_memory_and_time_and_keeps_whole_prompts_exact(smollm2, sample):
    model, tokenizer = smollm2
    ev = Evaluator(model, tokenizer, window=16)
    methods = [Method.parse(m) for m in ["full", "snapkv", "random", "kv8", "snapkv+kv8"]]
    reset_peak()
    t0 = time.perf_counter()
    records = ev.run(sample, methods, budgets=[40, 4096], max_new_tokens=4)
    elapsed = time.perf_counter() - t0
    peak = mx.get_peak_memory() / 2**30
    by = {(r["mode"], r["method"], r["budget"], r["question"]): r for r in records}
    # where the time went: the context's prefill once, then a call's scored pass and compaction
    # of every cell (agnostic: one call for both questions; aware: one a question), then every
    # call's cells answered together, within the run
    calls = {(r["mode"], r["question"] if r["mode"] == "aware" else None): r for r in records}
    parts = ("window_seconds", "compact_seconds")
    answered = ("sample_answer_seconds", "sample_answer_peak_gib", "sample_decode_loops")
    assert len(calls) == 3 and records[0]["sample_answer_seconds"] > 0
    spent = sum(r[k] for r in calls.values() for k in parts) + records[0]["sample_answer_seconds"]
    assert records[0]["prefill_seconds"] + spent <= elapsed
    for r in records:
        call = calls[r["mode"], r["question"] if r["mode"] == "aware" else None]
        assert [r[k] for k in parts] == [call[k] for k in parts]
        assert [r[k] for k in answered] == [records[0][k] for k in answered]
    # and the memory: the peak so far after each phase, rising through the calls (agnostic,
    # then each question asked) to the run's own peak, which the answers set
    phases = ("window_peak_gib", "compact_peak_gib")
    order = [calls["agnostic", None], calls["aware", 0], calls["aware", 1]]
    seen = [records[0]["prefill_peak_gib"]] + [c[k] for c in order for k in phases]
    seen.append(records[0]["sample_answer_peak_gib"])
    assert 0 < seen[0] and seen == sorted(seen) and abs(seen[-1] - peak) < 1e-3
    assert seen[-1] > seen[0]  # the cells' states and answers take memory beyond the prefill
    assert len(records) == 2 * 2 * (1 + 2 + 2 + 1 + 2)  # modes x questions x (method, budget)
    for mode in ("aware", "agnostic"):
        for q in (0, 1):
            full = by[(mode, "full", None, q)]
            assert full["kv_fraction"] == 1.0 and full["needle_kept"] == 1.0
            assert full["needle_kept_layers"] == [1.0] * 30  # SmolLM2's layers
            # a budget over the prompt keeps every row: the same answer as the full cache
            assert by[(mode, "snapkv", 4096, q)]["prediction"] == full["prediction"]
            assert by[(mode, "random", 4096, q)]["prediction"] == full["prediction"]
            small = by[(mode, "snapkv", 40, q)]
            assert small["rows"] == 40
            per_row = 1 + 4 / (2 * 64 * 4)  # float32 keys + values, and an int32 position per head
            assert abs(small["kv_fraction"] - 40 * per_row / full["rows"]) < 1e-9
            assert 0 <= small["needle_kept"] <= 1
            layers = small["needle_kept_layers"]  # every layer has 3 KV heads: the mean's mean
            assert len(layers) == 30 and abs(np.mean(layers) - small["needle_kept"]) < 1e-12
            kv8 = by[(mode, "kv8", None, q)]
            assert abs(kv8["kv_fraction"] - quantized_row_fraction(64, 4, 8)) < 1e-9
            both = by[(mode, "snapkv+kv8", 40, q)]
            assert both["rows"] == int(40 / quantized_row_fraction(64, 4, 8))
    # the agnostic full cache and the aware one compute the same thing in different chunks
    assert (
        by[("agnostic", "full", None, 0)]["prediction"]
        == by[("aware", "full", None, 0)]["prediction"]
    )


def test_records_name_the_phase_that_set_the_memory_peak(smollm2, sample, monkeypatch):
    model, tokenizer = smollm2
    ev = Evaluator(model, tokenizer, window=16)
    held = 0.25  # GiB that a phase holds for a moment, over what it needs

    def holding(phase):
        def run(*args, **kwargs):
            mx.eval(mx.zeros((int(held * 2**30) // 4,), mx.float32))
            return phase(*args, **kwargs)

        return run

    methods, budgets = [Method.parse("full"), Method.parse("snapkv")], [40]
    peaks = {}
    for phase in ("compact", "answers"):
        with monkeypatch.context() as m:
            m.setattr(ev, phase, holding(getattr(ev, phase)))
            reset_peak()
            r = ev.run(sample, methods, budgets, modes=["agnostic"])[0]
        peaks[phase] = [
            r[k] for k in ("window_peak_gib", "compact_peak_gib", "sample_answer_peak_gib")
        ]
    window, compact, answer = peaks["compact"]
    assert compact - window > 0.8 * held and answer - compact < 0.2 * held
    window, compact, answer = peaks["answers"]
    assert compact - window < 0.2 * held and answer - compact > 0.8 * held


def test_a_policy_of_ones_own_runs_in_the_evaluator_unchanged(smollm2, sample):
    import tests.test_policies  # noqa: F401  registers its EveryOther as "everyother"

    model, tokenizer = smollm2
    ev = Evaluator(model, tokenizer, window=16)
    records = ev.run(sample, [Method.parse("everyother")], budgets=[40], modes=["agnostic"])
    assert len(records) == 2 and all(r["rows"] == 40 for r in records)
    states = kvfn.prefill(ev.fm, mx.array([list(range(100))]))
    kept, evicted, seconds = ev.compact(states, None, Method.parse("everyother"), 40, 0)
    positions = np.array(kept[0].positions)[0, 0].tolist()
    middle = [p for p in positions if 4 <= p < 84]  # sinks 0-3 and window 84-99 kept
    assert evicted and positions[:4] == [0, 1, 2, 3] and positions[-16:] == list(range(84, 100))
    assert seconds == 0.0  # no scoring pass of its own
    assert len(middle) == 20 and all(p % 2 == 0 for p in middle)


def test_example_writes_json_tables_and_plots(tmp_path, capsys):
    out = tmp_path / "smoke"
    result = evaluate_example.main(["--lengths", "200", "--budgets", "48", "--tasks", "passkey",
                                    "niah_single", "--samples", "1", "--methods", "full", "snapkv",
                                    "streaming", "kv4", "--out", str(out), "--quiet",
                                    "--answer-tokens", "4"])  # fmt: skip
    saved = json.loads((tmp_path / "smoke.json").read_text())
    assert saved["config"]["answer_tokens"] == 4  # scores of a quicker run, told apart
    assert len(saved["records"]) == len(result["records"]) == 2 * 2 * 4
    assert saved["config"]["methods"] == ["full", "snapkv", "streaming", "kv4"]
    assert saved["config"]["card"] == mx.device_info()["device_name"]  # which card made them
    assert all(r["peak_gib"] > 0 for r in saved["records"])  # a sample's peak, to size workers
    assert all(r["sample_seconds"] > 0 for r in saved["records"])  # and its time, to plan calls
    table = (tmp_path / "smoke.md").read_text()
    assert "**average, query-agnostic**" in table and "**passkey, query-aware**" in table
    assert saved["leaders"] == report.leaders(saved["records"])
    assert table.index("**who answers most, query-aware") < table.index("**average, query-")
    for mode in ("aware", "agnostic"):
        assert (tmp_path / f"smoke-{mode}-200.png").stat().st_size > 10_000
        assert f"![smoke-{mode}-200](smoke-{mode}-200.png)" in table  # linked beside the tables
    assert "| 200 | full |" in capsys.readouterr().out
    later = evaluate_example.main(["--lengths", "200", "--budgets", "48", "--tasks", "passkey",
                                   "niah_single", "--samples", "1", "--first-sample", "1",
                                   "--methods", "full", "snapkv", "streaming", "kv4",
                                   "--out", str(tmp_path / "later"), "--quiet",
                                   "--answer-tokens", "4"])  # fmt: skip
    merged = evaluate_example.main(["--merge", str(tmp_path / "smoke.json"),
                                    str(tmp_path / "later.json"), "--out",
                                    str(tmp_path / "both")])  # fmt: skip
    assert merged["records"] == saved["records"] + later["records"]
    whole = dict(saved, config=dict(saved["config"], answer_tokens=None))  # each task's own
    (tmp_path / "whole.json").write_text(json.dumps(whole))
    with pytest.raises(SystemExit, match=r"different --answer-tokens .*\[4\].*\[None\]"):
        evaluate_example.main(["--merge", str(tmp_path / "both.json"),
                               str(tmp_path / "whole.json"), "--out", str(tmp_path / "mixed")])
    filling = ["--lengths", "200", "--tasks", "passkey", "niah_single", "--samples", "9",
               "--fill", "3", "--have", str(tmp_path / "smoke.json"),
               str(tmp_path / "later.json")]  # fmt: skip
    to_run = [(2, 200, "passkey"), (2, 200, "niah_single")]  # samples 0 and 1 are had
    assert evaluate_example.jobs(evaluate_example.parse(filling)) == to_run
    with pytest.raises(SystemExit, match="nothing to run: every .* cell has 2 samples"):
        evaluate_example.main(filling[:-4] + ["2", *filling[-3:]])
    zipped = evaluate_example.main(["--merge", str(tmp_path / "smoke.json"), "--gzip", "--out",
                                    str(tmp_path / "zipped")])  # fmt: skip
    assert not (tmp_path / "zipped.json").exists()
    assert gzip.decompress((tmp_path / "zipped.json.gz").read_bytes()).startswith(b"{")
    again = evaluate_example.main(["--merge", str(tmp_path / "zipped.json.gz"),
                                   str(tmp_path / "later.json"), "--out",
                                   str(tmp_path / "again")])  # fmt: skip
    assert again["records"] == merged["records"]  # a gzipped result merges like its JSON
    from_gzip = evaluate_example.parse(filling[:-2] + [str(tmp_path / "zipped.json.gz")])
    assert evaluate_example.jobs(from_gzip)[:2] == [(1, 200, "passkey"), (1, 200, "niah_single")]
    per_task = [c for c in merged["summary"] if c["task"] != "average"]
    assert {c["samples"] for c in per_task} == {2}  # a sample from each run, every cell
    with pytest.raises(SystemExit, match="both answer"):  # the same samples twice: refused
        evaluate_example.main(["--merge", str(tmp_path / "smoke.json"), str(tmp_path / "smoke.json"),
                               "--out", str(tmp_path / "twice")])  # fmt: skip


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--have", "x.json"], "--have: counts samples for --fill N; give --fill"),
        (["--fill", "2", "--have", "nowhere.json"], "--have: 'nowhere.json' is not a readable"),
        (["--fill", "0"], "--fill: must be >= 1, got 0"),
        (["--tasks", "nope"], "--tasks: unknown task 'nope'"),
        (["--methods", "snapkv+kv5"], "--methods: unknown method 'snapkv\\+kv5'"),
        (["--budgets", "20"], "--budgets: must be >= window \\+ sink tokens = 36, got 20"),
        (["--lengths", "50"], "--lengths: must be >= 128 tokens, got 50"),
        (["--samples", "0"], "--samples: must be >= 1, got 0"),
        (["--ask", "0"], "--ask: must be >= 1, got 0"),
        (["--workers", "0"], "--workers: must be >= 1, got 0"),
        (["--answer-tokens", "0"], "--answer-tokens: must be >= 1, got 0"),
        (["--first-sample", "-1"], "--first-sample: must be >= 0, got -1"),
        (["--deadline", "0"], "--deadline: must be > 0 seconds, got 0"),
        (["--deadline", "nan"], "--deadline: must be > 0 seconds, got nan"),
        (["--budgets", "1.5"], "a fraction in (0, 1) or a whole number of rows, got 1.5"),
        (
            ["--lengths", "130", "--tasks", "common_words"],
            "error: a common_words sample does not fit in 130 tokens",
        ),
    ],
)
def test_example_flags_are_checked(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        evaluate_example.main(argv)
    said = capsys.readouterr().err + str(exit_.value.code)  # argparse prints; SystemExit carries
    assert message.replace("\\", "") in said


def test_have_files_are_checked(tmp_path, capsys):
    """--have names a file that is no result, one whose records have no seed, or this run's
    own output: a clear error before anything runs."""
    (tmp_path / "text.json").write_text("not json")
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "bad.json.gz").write_bytes(b"not gzip")
    record = dict(task="passkey", target_tokens=200, seed=None)
    (tmp_path / "seedless.json").write_text(json.dumps(dict(records=[record])))
    (tmp_path / "out.json.gz").write_bytes(gzip.compress(b'{"records": []}'))
    for name, message in [
        ("text.json", "is not a readable result"),
        ("list.json", "is not a result: no list of records"),
        ("bad.json.gz", "is not a readable result"),
        ("seedless.json", "has records without a seed: they match no sample"),
        ("out.json.gz", "is also this run's output"),
    ]:
        argv = ["--fill", "2", "--have", str(tmp_path / name), "--gzip", "--out",
                str(tmp_path / "out")]  # fmt: skip
        with pytest.raises(SystemExit):
            evaluate_example.main(argv)
        assert message in capsys.readouterr().err


def test_duo_runs_in_the_evaluator_with_a_head_pattern(smollm2, sample):
    model, tokenizer = smollm2
    scores = np.random.default_rng(0).random((30, 3))
    pattern = kvfn.HeadPattern(scores=scores, sink_size=8, recent_size=32)
    ev = Evaluator(model, tokenizer, window=16, head_pattern=pattern)
    records = ev.run(sample, [Method.parse("full"), Method.parse("duo-r50")], budgets=[64],
                     modes=["agnostic"])  # fmt: skip
    duo = [r for r in records if r["method"] == "duo-r50"]
    full = [r for r in records if r["method"] == "full"]
    assert len(duo) == 2 and len(full) == 2
    P = full[0]["prompt_tokens"] - 8  # about the context; its rows are kept by retrieval heads
    # 45 of 90 heads keep every row, the others 8 + 32: between the two, and positions counted
    assert 0.5 < duo[0]["kv_fraction"] < 0.5 + 40 / P + 0.1
    assert 0 < duo[0]["needle_kept"] < 1
    with pytest.raises(ValueError, match="head pattern"):
        Evaluator(model, tokenizer).policy(Method.parse("duo-r50"), 64, 0)


def test_many_methods_decode_in_one_batch_as_they_would_alone(smollm2, sample):
    """Every call's cells decode together, batched by kind (``kvfn.stack``, ``ragged.stack``,
    ``partitioned.stack``: each its own rows): the same answers as one question at a time
    (batch 1), in fewer loops; and kvfn's decode gives mlx-lm's logits over the same kept
    rows."""
    from kvfn_eval.evaluator import greedy, kvfn_greedy

    model, tokenizer = smollm2
    methods = [Method.parse(m) for m in ["full", "snapkv", "chunkkv", "random", "streaming",
                                         "pyramidkv", "adakv", "duo-r50-snapkv"]]  # fmt: skip
    pattern = kvfn.HeadPattern(scores=np.random.default_rng(0).random((30, 3)), sink_size=8,
                               recent_size=32)  # fmt: skip
    runs = {
        batch: Evaluator(model, tokenizer, window=16, batch=batch, head_pattern=pattern).run(
            sample, methods, budgets=[40, 72], max_new_tokens=4  # a batch's loop, 60 questions
        )
        for batch in (1, 3, 64)
    }
    key = ("mode", "method", "budget", "question", "prediction", "kv_bytes", "needle_kept")
    for batch in (3, 64):
        assert [tuple(r[k] for k in key) for r in runs[batch]] == [
            tuple(r[k] for k in key) for r in runs[1]
        ]
    assert len({r["prediction"] for r in runs[1]}) > 1  # the methods do not all answer alike
    loops = {batch: records[0]["sample_decode_loops"] for batch, records in runs.items()}
    asks = len(runs[1])  # a record a question asked of a cell: 2 modes x 2 questions x 15 cells
    # batch 64: mlx-lm's full cache a question (4), then one batch each of the plain states (5
    # methods x 2 budgets x 4), of the ragged ones (Ada-KV's 8) and of Duo's at each budget
    # (its rings' sizes follow the budget)
    assert asks == 60 and loops == {1: 60, 3: 4 + 14 + 3 + 2 * 2, 64: 4 + 1 + 1 + 2}

    ev = Evaluator(model, tokenizer, window=16)
    prompt = prompt_tokens(tokenizer, sample, sample.questions[0])
    states, scores = kvfn.scored_prefill(ev.fm, mx.array([prompt.head]), window=16)
    kept = [kvfn.compact_states(states, scores, Method.parse(m).make_policy(b, window=16))[0]
            for m, b in [("snapkv", 40), ("random", 72)]]  # fmt: skip
    stacked = [kvfn.stack([a, b]) for a, b in zip(*kept)]
    tail = prompt.tail
    logits, _ = ev.fm.forward(mx.array([tail, tail]), stacked)
    for b, states_b in enumerate(kept):
        caches, _ = ev.caches(states_b, Method.parse("snapkv"), True)
        reference = model(mx.array([tail]), cache=caches)
        assert mx.allclose(logits[b], reference[0], atol=1e-4).item()
        caches, _ = ev.caches(states_b, Method.parse("snapkv"), True)
        assert kvfn_greedy(ev.fm, tail, stacked, 8, ev.eos, 2)[b] == greedy(
            model, tail, caches, 8, ev.eos
        )


def test_a_cells_rows_are_freed_once_answered(smollm2, sample):
    """The answers hold one batch's rows at a time, not every cell's: 16 cells of 20-95% of the
    rows, answered one question at a time, raise the peak by a fraction of their bytes (each
    cell kept until answered: more than all of them)."""
    model, tokenizer = smollm2
    budgets = [round(0.95 - 0.05 * i, 2) for i in range(16)]
    reset_peak()
    records = Evaluator(model, tokenizer, window=16, batch=1).run(
        sample, [Method.parse("random")], budgets, modes=["agnostic"], max_new_tokens=4
    )
    rise = records[0]["sample_answer_peak_gib"] - records[0]["compact_peak_gib"]
    cells = sum(r["kv_bytes"] for r in records if r["question"] == 0) / 2**30
    assert records[0]["sample_decode_loops"] == 2 * 16
    assert 0 < rise < 0.5 * cells


def test_head_positions_read_from_the_host_are_each_heads_rows():
    """The needle fraction's reading of a state's kept positions (its arrays evaluated once,
    then sliced on the host) gives each KV head's own rows, as ``ragged.head_rows`` does one
    head at a time, and a plain state's stored rows."""
    from kvfn_eval.evaluator import head_arrays, head_positions
    from tests.tiny import tiny_model

    fm = kvfn.FunctionalModel(tiny_model("qwen2"))
    ids = mx.array([np.random.default_rng(5).integers(0, 97, 60).tolist()])
    states, scores = kvfn.scored_prefill(fm, ids, window=4)
    ada = kvfn.compact_states(states, scores, kvfn.AdaKV(budget=12, window=4, sink_tokens=2))[0]
    snap = kvfn.compact_states(states, scores, SnapKV(budget=12, window=4, sink_tokens=2))[0]
    mx.eval([a for s in (*ada, *snap) for a in head_arrays(s)])
    for layer in ada:
        got = head_positions(layer)
        want = [np.array(kvfn.ragged.head_rows(layer, 0, h)[2]) for h in range(layer.n_kv_heads)]
        assert [g.tolist() for g in got] == [w.tolist() for w in want]
        assert len({len(g) for g in got}) > 1  # the heads keep different counts
    for layer in snap:
        assert [g.tolist() for g in head_positions(layer)] == [
            sorted(p for p in row if p != kvfn.EMPTY)
            for row in np.array(layer.positions)[0, :, : layer.max_rows].tolist()
        ]


def test_needle_fractions_are_each_heads_share_of_the_needle_rows():
    """Per full-attention layer and KV head, the needle tokens among the rows it keeps: a
    ragged head keeps its own, so the heads' shares differ; a sliding-window layer has none."""
    from kvfn_eval.evaluator import head_arrays, needle_fractions
    from tests.tiny import tiny_model

    fm = kvfn.FunctionalModel(tiny_model("qwen2"))
    ids = mx.array([np.random.default_rng(5).integers(0, 97, 60).tolist()])
    states, scores = kvfn.scored_prefill(fm, ids, window=4)
    ada = kvfn.compact_states(states, scores, kvfn.AdaKV(budget=12, window=4, sink_tokens=2))[0]
    mx.eval([a for s in ada for a in head_arrays(s)])
    needles = list(range(10, 40))
    got = needle_fractions(ada, needles)
    want = [[np.isin(needles, np.array(kvfn.ragged.head_rows(s, 0, h)[2])).mean()
             for h in range(s.n_kv_heads)] for s in ada]  # fmt: skip
    assert got == want and len({f for layer in got for f in layer}) > 1
    windowed = states[0].replace(sliding_window=8)
    assert needle_fractions([windowed, *ada[1:]], needles) == want[1:]


def test_a_batch_of_questions_out_of_length_order_is_refused(smollm2):
    """The chunks of one tail length stack in the order of their lengths: a batch given out of
    that order would pair answers with the wrong questions, so it is refused by name."""
    model, tokenizer = smollm2
    ev = Evaluator(model, tokenizer, window=16)
    states = kvfn.prefill(ev.fm, mx.array([list(range(40))]))
    with pytest.raises(ValueError, match=re.escape("sorted by length, got [2, 1]")):
        ev.prompted([(states, [5, 6]), (states, [7])], 4)


def test_budgets_below_one_are_fractions_of_the_prompt(smollm2, sample):
    model, tokenizer = smollm2
    ev = Evaluator(model, tokenizer, window=16)
    records = ev.run(sample, [Method.parse("snapkv")], budgets=[0.25, 0.125], modes=["agnostic"])
    for r in records:
        tail = prompt_tokens(tokenizer, sample, sample.questions[r["question"]]).tail
        P = r["prompt_tokens"] - len(tail)  # the context's rows, compacted once
        assert r["rows"] == max(16 + 4, round(r["budget"] * P))
    assert {r["budget"] for r in records} == {0.25, 0.125}
    with pytest.raises(ValueError, match="batch must be >= 1, got 0"):
        Evaluator(model, tokenizer, batch=0)


def test_workers_share_the_jobs_and_give_one_process_records(tmp_path):
    """A warm-up process and two workers: every job once (sample-major, so a deadline leaves
    cells evenly sampled), and the merged records equal one process's."""
    argv = ["--lengths", "200", "--budgets", "48", "--tasks", "passkey", "niah_multikey",
            "--samples", "2", "--questions", "2", "--ask", "1", "--methods", "full", "snapkv",
            "streaming", "--quiet", "--answer-tokens", "4"]  # fmt: skip
    args = evaluate_example.parse(argv)
    order = evaluate_example.jobs(args)
    assert order == [(0, 200, "passkey"), (0, 200, "niah_multikey"), (1, 200, "passkey"),
                     (1, 200, "niah_multikey")]  # fmt: skip
    shares = [evaluate_example.jobs(evaluate_example.parse(argv + ["--shard", s]))
              for s in ("warm", "0/2", "1/2")]  # fmt: skip
    assert shares[0] == [(0, 200, "passkey")]
    assert sorted(j for share in shares for j in share) == sorted(order)
    one = evaluate_example.main(argv + ["--out", str(tmp_path / "one")])
    many = evaluate_example.main(argv + ["--workers", "2", "--out", str(tmp_path / "many")])
    key = ("task", "seed", "mode", "method", "budget", "question", "prediction", "score")

    def rows(result):
        return sorted(tuple(r[k] for k in key) for r in result["records"])

    assert rows(many) == rows(one) and many["errors"] == []
    assert {r["question"] for r in one["records"]} == {0}  # --ask 1: one key asked
    assert not list(tmp_path.glob("many.part*"))  # the workers' parts are merged away


def test_a_deadline_counts_from_the_start_and_binds_every_worker(tmp_path, capfd, monkeypatch):
    """--deadline counts from main()'s start, the model's load included: a deadline shorter than
    the load starts no sample (counted from after the load, as it was, one ran); with workers,
    none is started past it, and each gets the parent's end time, not its own start's."""
    argv = ["--lengths", "200", "--budgets", "48", "--tasks", "passkey", "--samples", "2",
            "--methods", "full", "snapkv", "--quiet"]  # fmt: skip
    one = evaluate_example.main(argv + ["--deadline", "0.001", "--out", str(tmp_path / "one")])
    assert (
        one["records"] == [] and "deadline: stopped before 200 passkey #0" in capfd.readouterr().out
    )
    late = evaluate_example.main(argv + ["--deadline", "0.001", "--workers", "2",
                                         "--out", str(tmp_path / "late")])  # fmt: skip
    assert late["records"] == [] and not list(tmp_path.glob("late.part*"))
    assert "deadline: passed before the workers started" in capfd.readouterr().out

    commands = []

    class Started:  # a worker that is started and ends at once, with nothing to merge
        def __init__(self, cmd, env):
            commands.append(cmd)

        def wait(self):
            return 0

    monkeypatch.setattr(evaluate_example.subprocess, "Popen", Started)
    parent = evaluate_example.main(argv + ["--deadline", "600", "--workers", "2",
                                           "--out", str(tmp_path / "w")])  # fmt: skip
    stop_at = parent["config"]["stop_at"]
    assert stop_at > time.time() + 500
    shards = [evaluate_example.parse(cmd[2:]) for cmd in commands]
    assert [a.shard for a in shards] == ["warm", "0/2", "1/2"]
    assert all(a.stop_at == stop_at for a in shards)

    commands.clear()  # caches already warm: the workers start at once and share every job
    evaluate_example.main(argv + ["--workers", "2", "--no-warm-up", "--out", str(tmp_path / "n")])
    shards = [evaluate_example.parse(cmd[2:]) for cmd in commands]
    assert [a.shard for a in shards] == ["0/2", "1/2"]
    shares = [evaluate_example.jobs(a) for a in shards]
    assert sorted(j for share in shares for j in share) == sorted(
        evaluate_example.jobs(evaluate_example.parse(argv))
    )


@pytest.mark.parametrize("task", ["niah_multikey", "variable_tracking", "niah_single"])
def test_the_token_counter_counts_a_samples_longest_prompt(task):
    """``token_counter`` tokenizes the head once and the tails without the context: the same
    count as every question's prompt in full (``prompt_tokens``)."""
    from examples.benchmark_reuse import load_tokenizer
    from kvfn_eval import tasks
    from kvfn_eval.evaluator import prompt_tokens, token_counter

    tokenizer = load_tokenizer(None)
    count = token_counter(tokenizer)
    for seed in (0, 1):
        sample = tasks.generate(task, seed=seed, target_tokens=500, count_tokens=count,
                                n_questions=1 if task == "niah_single" else 3)  # fmt: skip
        prompts = [prompt_tokens(tokenizer, sample, q) for q in sample.questions]
        assert count(sample) == max(len(p.head) + len(p.tail) for p in prompts) <= 500


def test_a_peak_reset_frees_arrays_held_only_by_reference_cycles():
    """``reset_peak`` collects garbage first: an array held by a dropped reference cycle (which
    Python's collector might free mid-sample) is not the reset's level for every later peak."""
    import gc

    class Holder:
        pass

    holder = Holder()
    holder.cycle, holder.array = holder, mx.zeros((1 << 22,))
    mx.eval(holder.array)
    gc.collect()  # the holder, still reachable, moves to the oldest generation
    live = mx.get_active_memory()
    del holder
    reset_peak()
    mx.eval(mx.zeros((4,)))  # the peak counts what is live again at the next allocation
    assert mx.get_peak_memory() < live
