"""Bounded memory while prefilling: ``compact(..., max_rows=R)`` never holds more than R rows plus
a chunk, whatever the prompt's length, keeps every row's true position, and is the chunk-by-chunk
composition of the public steps (prefill a chunk over what is held, compact it back to the
cap; the last chunk, to the budget); a policy that cannot is refused by name and reason."""

import mlx.core as mx
import pytest

import kvfn
from kvfn.compaction import bounded_chunks
from kvfn.policies.policy import POLICIES as REGISTRY
from tests.test_shapes import LIBRARY, policy_of
from tests.tiny import tiny_model

STEP, WINDOW = 32, 8


@pytest.fixture(scope="module")
def fm():
    return kvfn.FunctionalModel(tiny_model("llama"))


def prompt(n: int, seed: int = 1) -> list:
    return mx.random.randint(0, 97, (1, n), key=mx.random.key(seed)).tolist()[0]


def first_logits(fm, ids, states):
    return fm.decode(mx.array([[ids[-1]]]), states)[0]


def test_a_cap_the_prompt_never_reaches_changes_nothing(fm):
    """(200 context tokens: the same chunks of 32 either way, the last one holding the window.)"""
    ids, policy = prompt(201), kvfn.SnapKV(budget=32, window=WINDOW)
    bounded, r = kvfn.compact(fm, ids, policy, max_rows=400, prefill_step_size=STEP)
    plain, _ = kvfn.compact(fm, ids, policy, prefill_step_size=STEP)
    assert r.peak_rows == 200
    assert mx.array_equal(first_logits(fm, ids, bounded), first_logits(fm, ids, plain)).item()


@pytest.mark.parametrize("name", ["snapkv", "streaming"])
def test_the_peak_is_the_cap_plus_a_chunk_at_any_length(fm, name):
    """However long the prompt, no more than max_rows + a chunk (the last: + the window) are
    held; the kept rows keep their true positions: the sinks, the last window, in order."""
    policy = kvfn.parse_policy(name, budget=32, **({} if name == "streaming" else {"window": 8}))
    peaks = []
    for n in (150, 400, 900):
        states, r = kvfn.compact(fm, prompt(n), policy, max_rows=48, prefill_step_size=STEP)
        peaks.append(r.peak_rows)
        assert r.peak_rows <= 48 + STEP + WINDOW and set(r.rows_after) == {32}
        for s in states:
            pos = s.positions[0, 0, :32].tolist()
            assert pos == sorted(pos) and len(set(pos)) == 32
            assert pos[:4] == [0, 1, 2, 3] and pos[-WINDOW:] == list(range(n - 1 - WINDOW, n - 1))
    assert max(peaks) - min(peaks) < WINDOW, peaks  # the last chunk alone differs


def test_it_is_the_chunk_by_chunk_composition_of_the_public_steps(fm):
    """The oracle: prefill a chunk after what is held (scoring its last queries), compact back
    to the cap (the policy keeping ``cap`` rows) with room for the next chunk when the cap is
    passed, and compact the last to the budget."""
    ids, policy, cap = prompt(300), kvfn.SnapKV(budget=32, window=WINDOW), 48
    got, r = kvfn.compact(fm, ids, policy, max_rows=cap, prefill_step_size=STEP,
                          max_new_tokens=4)  # fmt: skip
    context = mx.array([ids[:-1]])
    parts = bounded_chunks(context.shape[1], STEP, WINDOW)
    assert set(r.rows_before) == {cap + parts[-1][1] - parts[-1][0]}  # the last chose from these
    states, held = None, 0
    for j, (start, stop) in enumerate(parts):
        states, scores = kvfn.scored_prefill(fm, context[:, start:stop], window=WINDOW,
                                             states=states, prefill_step_size=STEP * 2)  # fmt: skip
        held += stop - start
        if held > cap and j + 1 < len(parts):
            room = parts[j + 1][1] - parts[j + 1][0]
            states, _ = kvfn.compact_states(states, scores, policy.replace(budget=cap),
                                            reserve=room)  # fmt: skip
            held = cap
    want, _ = kvfn.compact_states(states, scores, policy, reserve=5)
    assert mx.array_equal(first_logits(fm, ids, got), first_logits(fm, ids, want)).item()


@pytest.mark.parametrize("name", ["snapkv", "chunkkv"])
def test_a_probe_scores_each_compaction_by_the_prompts_last_window(fm, name):
    """The oracle of ``probe=True``: the chunks before the last prefilled unscored; when the
    cap is passed, the context's last window read after the rows held scores them (its own
    rows rolled back), and the states are compacted back to the cap; the last chunk as
    without a probe. It holds at most the cap + a chunk + the window, and keeps other rows."""
    ids, cap = prompt(300), 48
    policy = kvfn.parse_policy(name, budget=32, window=WINDOW)
    got, r = kvfn.compact(fm, ids, policy, max_rows=cap, prefill_step_size=STEP,
                          max_new_tokens=4, probe=True)  # fmt: skip
    context = mx.array([ids[:-1]])
    P = context.shape[1]
    parts = bounded_chunks(P, STEP, WINDOW)
    states, held = None, 0
    for j, (start, stop) in enumerate(parts):
        chunk = context[:, start:stop]
        if j + 1 == len(parts):
            states, scores = kvfn.scored_prefill(fm, chunk, window=WINDOW, states=states,
                                                 prefill_step_size=STEP * 2)  # fmt: skip
            break
        states = kvfn.prefill(fm, chunk, states=states, prefill_step_size=STEP)
        held += stop - start
        if held > cap:
            probed, scores = kvfn.scored_prefill(fm, context[:, P - WINDOW :], window=WINDOW,
                                                 states=states)  # fmt: skip
            assert [s.offset for s in probed] == [stop + WINDOW] * len(probed)  # read after
            states = tuple(kvfn.cache.rollback(s, WINDOW) for s in probed)
            room = parts[j + 1][1] - parts[j + 1][0]
            states, _ = kvfn.compact_states(states, scores, policy.holding(cap), reserve=room)
            held = cap
    want, _ = kvfn.compact_states(states, scores, policy, reserve=5)
    assert mx.array_equal(first_logits(fm, ids, got), first_logits(fm, ids, want)).item()
    assert r.peak_rows == cap + STEP + WINDOW
    plain, _ = kvfn.compact(fm, ids, policy, max_rows=cap, prefill_step_size=STEP)
    kept = [s.positions[0, :, :32] for s in got]
    assert {int(s.offset.item()) for s in got} == {P}  # each probe rolled back: no position skipped
    assert not all(mx.array_equal(a, s.positions[0, :, :32]).item() for a, s in zip(kept, plain))


@pytest.mark.parametrize(
    "name, kw, message",
    [
        ("snapkv", {}, "probe scores the compactions while prefilling: it takes max_rows"),
        ("streaming", {"max_rows": 40}, "'streaming' is not scored by an observation window"),
        ("kvzip", {"max_rows": 40}, "'kvzip' is not scored by an observation window"),
    ],
)
def test_a_probe_that_would_score_nothing_is_refused_by_name(fm, name, kw, message):
    policy = policy_of(name, fm)
    with pytest.raises(ValueError, match=message):
        kvfn.compact(fm, prompt(100), policy, **{"probe": True, **kw})


def test_a_probed_prompt_the_policy_keeps_whole_is_kept_whole(fm):
    ids, policy = prompt(17), policy_of("snapkv", fm)
    got, r = kvfn.compact(fm, ids, policy, max_rows=40, probe=True)
    assert set(r.rows_after) == {16} and r.peak_rows == 16
    want, _ = kvfn.compact(fm, ids, policy)
    assert mx.array_equal(first_logits(fm, ids, got), first_logits(fm, ids, want)).item()


def llama_of(layers: int):
    """The tiny llama with ``layers`` layers."""
    from mlx_lm.models import llama

    from tests.tiny import COMMON, FAMILIES

    settings = {**COMMON, **FAMILIES["llama"], "num_hidden_layers": layers}
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(dict(model_type="llama", **settings)))
    mx.eval(model.parameters())
    return kvfn.FunctionalModel(model)


def test_host_reads_do_not_grow_with_the_layers_or_the_chunks(monkeypatch):
    """The host knows the rows every layer holds: it reads none, between chunks or for the final
    compaction, and waits at most once a chunk, at 3 layers as at 6, at 12 chunks as at 25."""
    reads, waits = [], []
    for name in ("item", "tolist"):
        real = getattr(mx.array, name)
        read = lambda x, *a, _real=real, **k: reads.append(1) or _real(x, *a, **k)  # noqa: E731
        monkeypatch.setattr(mx.array, name, read)
    real_eval = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a, **k: waits.append(1) or real_eval(*a, **k))
    policy, got = kvfn.SnapKV(budget=32, window=WINDOW), {}
    for layers in (3, 6):
        fm = llama_of(layers)
        for n in (400, 800):
            ids = prompt(n)
            reads.clear(), waits.clear()
            kvfn.compact(fm, ids, policy, max_rows=48, prefill_step_size=STEP)
            chunks = len(bounded_chunks(n - 1, STEP, WINDOW))
            got[layers, n] = len(reads)
            assert len(waits) <= chunks, (layers, n, len(waits), chunks)
    assert set(got.values()) == {0}, got


def test_compiled_chunk_compactions_keep_what_eager_ones_keep(fm):
    """``compiled``: each chunk's compaction in its one compiled trace, at prompts of two
    lengths; the same rows and logits as eagerly."""
    policy = kvfn.SnapKV(budget=32, window=WINDOW)
    for n in (300, 333):
        ids = prompt(n)
        eager, _ = kvfn.compact(fm, ids, policy, max_rows=48, prefill_step_size=STEP)
        compiled, _ = kvfn.compact(fm, ids, policy, max_rows=48, prefill_step_size=STEP,
                                   compiled=True)  # fmt: skip
        for a, b in zip(eager, compiled):
            assert mx.array_equal(a.positions[..., :32], b.positions[..., :32]).item()
        assert mx.array_equal(first_logits(fm, ids, eager), first_logits(fm, ids, compiled)).item()


def test_what_it_keeps_decodes_as_fast_as_a_compaction_after_the_prefill(fm):
    """Rows compacted while prefilling are packed as after the prefill (a slot comparison, not a
    per-head mask from positions): they decode through the same compiled step, and as the same
    rows read through the per-head mask do."""
    ids, policy = prompt(300), kvfn.SnapKV(budget=32, window=WINDOW)
    after, _ = kvfn.compact(fm, prompt(300, seed=2), policy, prefill_step_size=STEP)
    first_logits(fm, ids, after)
    traces = fm.traces
    got, r = kvfn.compact(fm, ids, policy, max_rows=48, prefill_step_size=STEP)
    assert r.peak_rows < 299 and all(s.packed for s in got)
    logits = first_logits(fm, ids, got)
    assert fm.traces == traces
    unpacked = tuple(s.replace(packed=False) for s in got)
    assert mx.allclose(logits, first_logits(fm, ids, unpacked), atol=1e-5).item()


def test_kvzip_with_a_cap_never_reached_is_kvzip(fm):
    """Scored once, at the end, over every row: the pass's chunks over the whole context."""
    ids, policy = prompt(201), kvfn.parse_policy("kvzip-c48", budget=32, window=WINDOW)
    bounded, r = kvfn.compact(fm, ids, policy, max_rows=400, prefill_step_size=STEP)
    plain, _ = kvfn.compact(fm, ids, policy, prefill_step_size=STEP)
    assert r.peak_rows == 200
    assert mx.array_equal(first_logits(fm, ids, bounded), first_logits(fm, ids, plain)).item()


def by_position(scores, states, rows: int) -> list:
    """Each layer's {(query head, position): score} of the first ``rows`` rows, on the host."""
    out = []
    for s, st in zip(scores, states):
        group = s.shape[1] // st.positions.shape[1]
        pos, s = st.positions[0].tolist(), s[0].tolist()
        out.append({(q, pos[q // group][i]): s[q][i] for q in range(len(s)) for i in range(rows)})
    return out


def test_kvzip_scores_each_chunk_once_over_what_is_held(fm):
    """KVzip evicting while prefilling: when a compaction is due, the chunks not scored yet are
    scored by the reconstruction pass over what is held (the first time: KVzip's own pass over
    a plain prefill of the context so far), the states are compacted back to the cap, and a
    kept row keeps its score, by position, until it is evicted. Composed here from the public
    steps, the scores carried on the host."""
    from kvfn.passes import _drain
    from kvfn.policies.kvzip import held_reconstruction_steps, reconstruction_scores

    ids, cap = prompt(300), 48
    policy = kvfn.parse_policy("kvzip-c16", budget=32, window=WINDOW)
    got, r = kvfn.compact(fm, ids, policy, max_rows=cap, prefill_step_size=STEP,
                          max_new_tokens=4)  # fmt: skip
    assert r.peak_rows <= cap + STEP + WINDOW and set(r.rows_after) == {32}
    context = mx.array([ids[:-1]])
    settings = dict(prompt=(), resume=(), suffix=(), chunk=16, overlap=policy.overlap,
                    sink=policy.sink_tokens)  # fmt: skip
    parts = bounded_chunks(context.shape[1], STEP, WINDOW)
    states, held, unscored, carried, first = None, 0, 0, None, True
    for j, (start, stop) in enumerate(parts):
        states = kvfn.prefill(fm, context[:, start:stop], states=states,
                              capacity=stop - start, prefill_step_size=STEP)  # fmt: skip
        held += stop - start
        last = j + 1 == len(parts)
        if not (last or held > cap):
            continue
        scores = _drain(held_reconstruction_steps(fm, context[:, :stop], states, unscored,
                                                  carried, **settings), None)  # fmt: skip
        if first:  # nothing evicted yet: the pass itself
            want = reconstruction_scores(fm, context[:, :stop], states, **settings)
            assert all(mx.array_equal(a, b).item() for a, b in zip(scores, want))
            first = False
        unscored = stop
        if last:
            break
        room = parts[j + 1][1] - parts[j + 1][0]
        new, _ = kvfn.compact_states(states, scores, policy.replace(budget=cap), reserve=room)
        old = by_position(scores, states, held)
        carried = tuple(
            mx.array(
                [
                    [
                        [
                            table[(q, p)]
                            for p in st.positions[
                                0, q // (s.shape[1] // st.positions.shape[1]), :cap
                            ].tolist()
                        ]
                        for q in range(s.shape[1])
                    ]
                ]
            )
            for table, s, st in zip(old, scores, new)
        )
        states, held = new, cap
    want, _ = kvfn.compact_states(states, scores, policy, reserve=5)
    assert mx.array_equal(first_logits(fm, ids, got), first_logits(fm, ids, want)).item()


@pytest.mark.parametrize("name", LIBRARY)
def test_every_policy_evicts_while_prefilling_or_is_refused_by_name(fm, name):
    policy = policy_of(name, fm)
    ids = prompt(160)
    if REGISTRY[name].cannot_recompact:
        with pytest.raises(ValueError, match=f"{name} cannot evict while prefilling: .+"):
            kvfn.compact(fm, ids, policy, max_rows=policy.budget)
        return
    if REGISTRY[name].bounds_itself:  # Duo: its streaming heads become rings, its retrieval
        _, r = kvfn.compact(fm, ids, policy, max_rows=10, prefill_step_size=16)  # heads whole
        assert r.peak_rows == len(ids) - 1
        return
    for cap in (policy.budget, policy.budget + 16):  # a cap above the budget: held, then cut
        _, r = kvfn.compact(fm, ids, policy, max_rows=cap, prefill_step_size=16)
        assert r.peak_rows <= cap + 16 + policy.window
        assert set(r.rows_after) == {policy.budget}


def test_a_policy_holds_the_cap_while_prefilling_and_an_allocation_its_budget():
    """``holding(R)``: what a compaction before the last keeps under a cap of R rows."""
    p = kvfn.SnapKV(budget=32, window=WINDOW)
    assert p.holding(32) is p and p.holding(48) == p.replace(budget=48)
    ada = kvfn.AdaKV(budget=32, window=WINDOW)
    assert ada.holding(48) is ada


def test_past_the_cap_every_chunk_holds_the_cap_plus_a_chunk(fm):
    """A cap above the budget is held: once reached, every chunk brings R rows to R + a chunk."""
    policy, cap = kvfn.SnapKV(budget=32, window=WINDOW), 80
    for n in (400, 733):
        _, r = kvfn.compact(fm, prompt(n), policy, max_rows=cap, prefill_step_size=STEP)
        last = bounded_chunks(n - 1, STEP, WINDOW)[-1]
        assert r.peak_rows == cap + max(STEP, last[1] - last[0])
        assert set(r.rows_before) == {cap + last[1] - last[0]}
        assert set(r.rows_after) == {32}


@pytest.mark.parametrize(
    "max_rows, settings, message",
    [
        (31, {}, "max_rows must be an int >= the policy's budget 32, got 31"),
        (40, {"min_tokens": 64}, "max_rows 40 is below the policy's min_tokens 64"),
    ],
)
def test_bad_caps_are_refused_by_value(fm, max_rows, settings, message):
    policy = kvfn.SnapKV(budget=32, window=WINDOW, **settings)
    with pytest.raises(ValueError, match=message):
        kvfn.compact(fm, prompt(100), policy, max_rows=max_rows)


def test_a_model_with_sliding_window_layers_is_refused():
    fm = kvfn.FunctionalModel(tiny_model("gemma3_text"))
    with pytest.raises(ValueError, match="sliding-window layers"):
        kvfn.compact(fm, prompt(100), kvfn.SnapKV(budget=32, window=WINDOW), max_rows=40)


# -- while generating ----------------------------------------------------------------------------
def run(gen) -> tuple[list, tuple]:
    tokens = []
    while True:
        try:
            tokens.append(next(gen).item())
        except StopIteration as end:
            return tokens, end.value


def compacted(fm, n=100, budget=32, new=16):
    ids = prompt(n)
    policy = kvfn.SnapKV(budget=budget, window=WINDOW)
    return ids, policy, kvfn.compact(fm, ids, policy, max_new_tokens=new)[0]


def test_a_generation_shorter_than_its_interval_is_the_plain_decode_loop(fm):
    ids, policy, states = compacted(fm)
    got, _ = run(kvfn.bounded_decode(fm, mx.array([[ids[-1]]]), states, policy, steps=20,
                                     interval=64))  # fmt: skip
    token, want = mx.array([[ids[-1]]]), []
    for _ in range(20):
        logits, states = fm.decode(token, states)
        token = mx.argmax(logits, axis=-1)[:, None]
        want.append(token.item())
    assert got == want


def test_generating_is_the_composition_of_scored_steps_and_compactions(fm):
    """The oracle: decode; over the last window of queries before budget + interval rows, a
    scored step adding their attention; at budget + interval, compact_states back to the
    budget with room up to the bucket."""
    ids, policy, states = compacted(fm)
    interval, steps = 40, 130
    got, _ = run(kvfn.bounded_decode(fm, mx.array([[ids[-1]]]), states, policy, steps=steps,
                                     interval=interval))  # fmt: skip
    cap, capacity = 32 + interval, kvfn.wrapper.bucket(32 + interval)
    token, held, scores, want = mx.array([[ids[-1]]]), states[0].max_rows, None, []
    for _ in range(steps):
        if held + 1 > cap - WINDOW:
            if scores is None:
                states = tuple(kvfn.reserve(s, max(s.capacity, capacity)) for s in states)
                scores = tuple(mx.zeros((1, h, states[0].capacity)) for h in fm.n_heads)
            logits, states, scores = fm.scored_step(token, states, scores, kvfn.QuerySlice(0, 1))
        else:
            logits, states = fm.decode(token, states)
        held += 1
        token = mx.argmax(logits, axis=-1)[:, None]
        want.append(token.item())
        if held == cap:
            states, _ = kvfn.compact_states(states, scores, policy, reserve=capacity - 32)
            held, scores = 32, None
    assert got == want


def test_a_long_generation_holds_the_budget_plus_an_interval_and_traces_a_few_times(fm):
    """However many tokens: the rows held stay under budget + interval in one capacity, every
    row keeps its true position, and the trace count does not grow with the compactions."""
    ids, policy, states = compacted(fm)
    traces = []
    for steps in (200, 600):
        local = kvfn.FunctionalModel(fm.model)
        tokens, final = run(kvfn.bounded_decode(local, mx.array([[ids[-1]]]), states, policy,
                                                steps=steps, interval=40))  # fmt: skip
        traces.append(local.traces)
        s = final[0]
        assert len(tokens) == steps and s.capacity == kvfn.wrapper.bucket(72) and s.max_rows <= 72
        pos = s.positions[0, 0, : s.max_rows].tolist()
        last = len(ids) - 2 + steps  # the true position of the newest row
        assert pos == sorted(pos) and pos[:4] == [0, 1, 2, 3] and pos[-1] == last
    assert traces[0] == traces[1] <= 4, traces


def test_what_cannot_evict_while_generating_is_refused_by_name(fm):
    ids, policy, states = compacted(fm)
    token = mx.array([[ids[-1]]])
    with pytest.raises(ValueError, match="kvzip cannot evict while generating: its scores"):
        kvfn.bounded_decode(fm, token, states, kvfn.KVzip(budget=32, window=WINDOW), steps=4)
    with pytest.raises(ValueError, match="interval must be an int > the policy's window 8"):
        kvfn.bounded_decode(fm, token, states, policy, steps=4, interval=8)
    ragged, _ = kvfn.compact(fm, ids, kvfn.AdaKV(budget=32, window=WINDOW))
    with pytest.raises(ValueError, match="bounded_decode takes plain layer states"):
        kvfn.bounded_decode(fm, token, ragged, policy, steps=4)


def test_the_last_chunk_holds_the_whole_window_whatever_the_step(fm):
    """Chunks shorter than the window: the last still starts a window before the end, so a cap
    the prompt never reaches keeps the rows a plain compaction keeps."""
    ids, policy = prompt(201), kvfn.SnapKV(budget=48, window=32)
    assert bounded_chunks(200, 8, 32)[-1] == (168, 200)
    bounded, _ = kvfn.compact(fm, ids, policy, max_rows=400, prefill_step_size=8)
    plain, _ = kvfn.compact(fm, ids, policy, prefill_step_size=8)
    for a, b in zip(bounded, plain):
        assert a.positions[:, :, :48].tolist() == b.positions[:, :, :48].tolist()


def test_a_policy_that_does_not_say_it_can_is_refused(fm):
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Heaviest(kvfn.SnapKV):
        name = "heaviest-test"
        cannot_recompact = kvfn.Policy.cannot_recompact  # as a Policy subclass of its own

    with pytest.raises(ValueError, match="heaviest-test cannot evict while prefilling: it does"):
        kvfn.compact(fm, prompt(100), Heaviest(budget=32, window=WINDOW), max_rows=40)


def test_generating_cuts_a_callers_larger_room_to_one_capacity(fm):
    ids, policy, states = compacted(fm, new=2000)
    assert states[0].capacity > 2000
    _, final = run(kvfn.bounded_decode(fm, mx.array([[ids[-1]]]), states, policy, steps=3,
                                       interval=40))  # fmt: skip
    assert {s.capacity for s in final} == {kvfn.wrapper.bucket(72)}


def test_quality_bounded_asks_every_config_the_same_questions(capsys, tmp_path, monkeypatch):
    """The quality example's four configs: with more rows than the prompt nothing is evicted
    and all answer as mlx-lm's full cache (both modes); with fewer (rows, or a ratio of the
    prompt), each is scored on the same question, and the table pairs bounded with the rest."""
    import json

    from examples import quality_bounded

    monkeypatch.setitem(quality_bounded.ANSWER_TOKENS, "passkey", 4)  # answers compared, not scored

    whole = quality_bounded.main(["--tasks", "passkey", "--lengths", "160", "--samples", "1",
                                  "--rows", "512", "--window", "8", "--prefill-step-size", "64",
                                  "--modes", "aware", "agnostic"])  # fmt: skip
    aware, agnostic = whole["rows"]
    assert aware["length"] <= 160 and (aware["mode"], agnostic["mode"]) == ("aware", "agnostic")
    assert agnostic["held"] < aware["held"]  # the context alone, then the question
    for row in whole["rows"]:
        assert len(set(row["answers"].values())) == 1
    out = tmp_path / "q.json"
    cut = quality_bounded.main(["--tasks", "passkey", "--lengths", "160", "--samples", "1",
                                "--ratios", "0.15", "--window", "8", "--prefill-step-size", "64",
                                "--modes", "aware", "agnostic", "--out", str(out)])  # fmt: skip
    assert [r["rows"] for r in cut["rows"]] == [round(0.15 * r["held"]) for r in cut["rows"]]
    assert all(r["peak_rows"] <= r["rows"] + 64 for r in cut["rows"])
    for mode, row in zip(("aware", "agnostic"), cut["rows"]):
        table = [t for t in cut["table"] if t["mode"] == mode]
        assert sorted(t["config"] for t in table) == sorted(quality_bounded.configs("chunkkv"))
        assert row["answers"]["mlx-lm full"] == whole["rows"][0]["answers"]["mlx-lm full"]
        assert all(0.0 <= t["score"] <= 100.0 and t["questions"] == 1 for t in table)
        (bounded,) = [t for t in table if t["config"] == "kvfn chunkkv bounded"]
        for ref, name in (("kvfn chunkkv", "vs_after_prefill"), ("mlx-lm rotating", "vs_rotating")):
            theirs = next(t["score"] for t in table if t["config"] == ref)
            assert bounded[name]["difference"] == pytest.approx(bounded["score"] - theirs)
    assert json.loads(out.read_text())["table"] == cut["table"]
    again = quality_bounded.main(["--merge", str(out), str(out)])  # a question counted once
    assert again["table"] == cut["table"] and len(again["rows"]) == len(cut["rows"])
    other = tmp_path / "q1.json"
    quality_bounded.main(["--tasks", "passkey", "--lengths", "160", "--samples", "1",
                          "--first-sample", "1", "--ratios", "0.15", "--window", "8",
                          "--prefill-step-size", "64", "--modes", "aware", "--out", str(other)])  # fmt: skip
    both = quality_bounded.main(["--merge", str(out), str(other)])
    assert len(both["rows"]) == 3
    assert {(t["mode"], t["questions"]) for t in both["table"]} == {("aware", 2), ("agnostic", 1)}
    assert "kvfn chunkkv bounded" in capsys.readouterr().out
    capped = json.loads(other.read_text())
    capped["args"]["cap_factor"] = 2.0
    (tmp_path / "q2.json").write_text(json.dumps(capped))
    with pytest.raises(SystemExit, match="different cap_factors"):  # not one table's questions
        quality_bounded.main(["--merge", str(out), str(tmp_path / "q2.json")])
    # a cap above the prompt: nothing is evicted while prefilling, the same answer as after it
    (never,) = quality_bounded.main(["--tasks", "passkey", "--lengths", "160", "--samples", "1",
                                     "--ratios", "0.15", "--window", "8", "--prefill-step-size",
                                     "64", "--cap-factor", "100"])["rows"]  # fmt: skip
    assert never["answers"]["kvfn chunkkv bounded"] == never["answers"]["kvfn chunkkv"]
    assert never["peak_rows"] > never["rows"] + 64
    with pytest.raises(SystemExit):
        quality_bounded.main(["--cap-factor", "0.5"])
    with pytest.raises(SystemExit):
        quality_bounded.main(["--rows", "8", "--window", "8"])
    with pytest.raises(SystemExit):
        quality_bounded.main(["--ratios", "1.5"])
    with pytest.raises(SystemExit):
        quality_bounded.main(["--policy", "adakv", "--samples", "1", "--lengths", "160"])  # ragged


def test_quality_bounded_asks_again_a_question_that_ran_out_of_memory(capsys, tmp_path,
                                                                       monkeypatch):
    """Processes sharing a GPU can run it out of memory for a moment: that question is asked
    once more (the rows of its budgets already answered are dropped, not kept twice), then
    skipped in every config and recorded; any other error still stops the run."""
    import json

    from examples import quality_bounded

    monkeypatch.setattr(quality_bounded, "RETRY_SECONDS", 0)
    monkeypatch.setitem(quality_bounded.ANSWER_TOKENS, "passkey", 4)  # answers compared, not scored
    answer, calls, fail = quality_bounded.kvfn_answer, [0], set()

    def flaky(*args, **kwargs):  # 4 calls a question: 2 budgets, after the prefill and bounded
        calls[0] += 1
        if calls[0] in fail:
            raise RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")
        return answer(*args, **kwargs)

    monkeypatch.setattr(quality_bounded, "kvfn_answer", flaky)
    run = ["--tasks", "passkey", "--lengths", "160", "--samples", "2", "--ratios", "0.15", "0.3",
           "--window", "8", "--prefill-step-size", "64"]  # fmt: skip
    answered = tmp_path / "q1.json"  # the first question alone, clean
    clean = quality_bounded.main(run[:5] + ["1"] + run[6:] + ["--out", str(answered)])["rows"]
    assert "out of memory" not in capsys.readouterr().out
    out = tmp_path / "q.json"
    calls[0], fail = 0, {3}  # the first question's second budget
    once = quality_bounded.main(run + ["--out", str(out)])
    assert [(r["seed"], r["budget_index"]) for r in once["rows"]] == [(0, 0), (0, 1), (1, 0),
                                                                      (1, 1)]  # fmt: skip
    assert [r["answers"] for r in once["rows"][:2]] == [r["answers"] for r in clean]
    assert once["skipped"] == [] and "asking again" in capsys.readouterr().out
    calls[0], fail = 0, {3, 7}  # the first question runs out twice: skipped, the next answered
    twice = quality_bounded.main(run + ["--out", str(out)])
    assert [r["seed"] for r in twice["rows"]] == [1, 1]
    assert [(q["task"], q["seed"], q["mode"]) for q in twice["skipped"]] == [("passkey", 0,
                                                                               "aware")]
    assert json.loads(out.read_text())["skipped"] == twice["skipped"]
    assert quality_bounded.main(["--merge", str(out)])["skipped"] == twice["skipped"]
    assert quality_bounded.main(["--merge", str(out), str(answered)])["skipped"] == []
    tries, skipped = [], []

    def out_of_memory():
        tries.append(1)
        raise RuntimeError("out of memory")

    # past the deadline: no second try
    assert quality_bounded.retried(out_of_memory, {"seed": 0}, skipped, late=lambda: True) == []
    assert len(tries) == 1 and skipped == [{"seed": 0, "error": "out of memory"}]

    def broken(*args, **kwargs):
        raise RuntimeError("[gather] indices out of bounds")

    monkeypatch.setattr(quality_bounded, "kvfn_answer", broken)
    with pytest.raises(RuntimeError, match="out of bounds"):
        quality_bounded.main(run)


def test_profile_first_request_times_every_chunk_of_each_request(capsys):
    from examples import profile_first_request as pfr

    out = pfr.main(["--prompt-tokens", "300", "--rows", "48", "--window", "8", "--new-tokens",
                    "3", "--prefill-step-size", "64", "--requests", "2"])  # fmt: skip
    assert [r["prompt_tokens"] for r in out["rows"]] == [300, 263]
    # a cap only the last chunk passes (every step counted once), and a single chunk
    late = pfr.main(["--prompt-tokens", "300", "--rows", "256", "--window", "8", "--new-tokens",
                     "3", "--prefill-step-size", "64", "--requests", "1"])  # fmt: skip
    one = pfr.main(["--prompt-tokens", "60", "--rows", "48", "--window", "8", "--new-tokens",
                    "3", "--prefill-step-size", "64", "--requests", "1"])  # fmt: skip
    assert late["rows"][0]["first compaction"] == 0.0 and one["rows"][0]["chunks"] == 1
    for r in out["rows"] + late["rows"] + one["rows"]:
        assert r["chunks"] == len(bounded_chunks(r["prompt_tokens"] - 1, 64, 8))
        assert r["peak_rows"] <= 48 + 64 + 8 or r is late["rows"][0]
        steps = [r[s] for s in pfr.STEPS]
        assert min(steps) >= 0 and sum(steps) <= r["total"] + 1e-6
    assert "first request less the mean of the later ones" in capsys.readouterr().out


def test_benchmark_memory_bounds_the_peak_rows_and_prints_each_run(capsys):
    from examples import benchmark_memory

    out = benchmark_memory.main(["--prompt-tokens", "300", "--rows", "48", "--window", "8",
                                 "--new-tokens", "4", "--prefill-step-size", "64"])  # fmt: skip
    by = {r["config"]: r for r in out}
    assert by["kvfn snapkv bounded"]["peak_rows"] <= 48 + 64
    assert by["kvfn snapkv bounded"]["kv_held_gb"] == pytest.approx(by["kvfn snapkv"]["kv_held_gb"])
    assert by["mlx-lm rotating"]["kv_held_gb"] < by["mlx-lm full"]["kv_held_gb"]
    runs = [line for line in capsys.readouterr().out.splitlines() if line.startswith('{"round"')]
    assert len(runs) == 2 * len(benchmark_memory.CONFIGS)  # a warm-up round and a measured one
    (capped,) = benchmark_memory.main(["--prompt-tokens", "300", "--rows", "48", "--max-rows",
                                       "112", "--window", "8", "--new-tokens", "4",
                                       "--prefill-step-size", "64", "--configs",
                                       "kvfn snapkv bounded"])  # fmt: skip
    assert 48 + 64 < capped["peak_rows"] <= 112 + 64  # compacted back to 112, not 48
    assert capped["kv_held_gb"] == pytest.approx(by["kvfn snapkv bounded"]["kv_held_gb"])
    (per_layer,) = benchmark_memory.main(["--prompt-tokens", "300", "--rows", "48", "--window",
                                          "8", "--new-tokens", "4", "--prefill-step-size", "64",
                                          "--configs", "kvfn snapkv bounded per-layer"])  # fmt: skip
    for key in ("peak_rows", "kv_held_gb"):  # the same rows, selected a layer at a time
        assert per_layer[key] == by["kvfn snapkv bounded"][key]
    assert not benchmark_memory.PerLayerSnapKV.same_in_every_layer
    duo, capped_duo = benchmark_memory.main(["--prompt-tokens", "300", "--rows", "48",
                                             "--window", "8", "--new-tokens", "4",
                                             "--prefill-step-size", "64", "--configs",
                                             "kvfn duo,kvfn duo bounded"])  # fmt: skip
    assert duo["peak_rows"] is None and capped_duo["peak_rows"] is not None
    assert capped_duo["peak_rows"] > by["kvfn snapkv bounded"]["peak_rows"]  # a retrieval head
    assert duo["kv_held_gb"] == pytest.approx(capped_duo["kv_held_gb"])
    with pytest.raises(SystemExit):
        benchmark_memory.main(["--rows", "48", "--max-rows", "40"])


def test_benchmark_generation_caps_every_evicting_config_and_prints_each(capsys):
    from examples import benchmark_generation

    out = benchmark_generation.main(["--prompt-tokens", "20", "--new-tokens", "600", "--rows",
                                     "64", "--interval", "24", "--window", "8"])  # fmt: skip
    by = {r["config"]: r for r in out}
    assert [r["config"] for r in out] == list(benchmark_generation.CONFIGS)
    for config in ("mlx-lm rotating", "kvfn bounded_decode", "mlx-lm over kvfn evicting"):
        assert by[config]["most_rows"] <= 64 < by["mlx-lm full"]["most_rows"], config
        assert by[config]["kv_held_gb"] < by["mlx-lm full"]["kv_held_gb"], config
    assert "mlx-lm over kvfn evicting" in capsys.readouterr().out


def test_profile_bounded_reads_nothing_and_selects_once_for_every_layer(capsys):
    """The bounded prefill's profile: no host read in a whole prefill, and a steady chunk's
    compaction graph selects once for all its layers (SnapKV is the same in every layer) and
    gathers keys, values and positions in each."""
    from examples import profile_bounded

    out = profile_bounded.main(["--prompt-tokens", "300", "--rows", "48", "--chunk", "32",
                                "--window", "8", "--rounds", "1", "--repeats", "1"])  # fmt: skip
    layers = profile_bounded.THIN["num_hidden_layers"]
    ops = out["compaction graph"]
    assert out["reads"] == 0 and out["evals"] >= 1
    assert ops["ArgPartition"] == 1 and ops["GatherAxis"] == 3 * layers
    assert "compaction graph" in capsys.readouterr().out


def test_perplexity_bounded_reads_the_text_the_full_cache_reads_until_the_cap(capsys):
    """Until the cap is first reached every capped cache is the full cache (the same losses);
    after it they hold at most the cap."""
    from examples import perplexity_bounded

    out = perplexity_bounded.main(["--tokens", "160", "--rows", "96", "--interval", "32",
                                   "--window", "8", "--configs",
                                   "full cache,mlx-lm rotating,kvfn snapkv"])  # fmt: skip
    by = {r["config"]: r for r in out}
    assert by["full cache"]["most_rows"] == 159
    for config in ("mlx-lm rotating", "kvfn snapkv"):
        assert by[config]["most_rows"] <= 96 and by[config]["agree_with_full"] >= 95 / 159
    assert "kvfn snapkv" in capsys.readouterr().out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_duo_evicts_while_prefilling_as_duoattention_s_chunked_prefill(family):
    """Evicting while prefilling, Duo's streaming heads become rings the first time the rows
    held pass the cap (DuoAttention's chunked prefill), so from the next chunk on their queries
    see the sinks and the last ``recent`` positions, and its retrieval heads every row. The
    oracle: one pass of the unmodified model with those masks, through the prompt and decode
    steps. The streaming heads hold at most the cap plus a chunk; the most a head holds is a
    retrieval head's whole prompt."""
    from tests.test_duo import PATTERN, TOL, duo_visibility, greedy_logits, reference_logits

    fm = kvfn.FunctionalModel(tiny_model(family))
    policy = kvfn.Duo(retrieval=PATTERN[: len(fm.n_kv_heads)], sink_tokens=2, recent=8)
    ids = prompt(121, seed=4)
    P = len(ids) - 1
    states, r = kvfn.compact(fm, ids, policy, max_rows=24, prefill_step_size=16,
                             max_new_tokens=6)  # fmt: skip
    split = next(b for a, b in bounded_chunks(P, 16, policy.window) if b > 24)  # 32
    got, tokens = greedy_logits(fm, ids, states, 6)
    T = len(tokens) - 1
    seq = mx.array([tokens[:T]])
    want = reference_logits(fm.model, seq, duo_visibility(fm, states, P, T, policy, split))[P:]
    assert mx.abs(got - want).max().item() < TOL
    after = reference_logits(fm.model, seq, duo_visibility(fm, states, P, T, policy))[P:]
    assert mx.abs(want - after).max().item() > 10 * TOL  # the oracle tells it from Duo after
    assert r.peak_rows == P and len(r.rows_before) == len(states)
    after_prefill, _ = kvfn.compact(fm, ids, policy, prefill_step_size=16, max_new_tokens=6)
    for s, a in zip(states, after_prefill):
        plain, ring = s.parts
        assert plain.max_rows == P and ring.sink + ring.recent == 10
        # the retrieval heads' part reserved once: the capacity Duo after the prefill has
        assert plain.capacity == a.parts[0].capacity == P + 7
    same, r_same = kvfn.compact(fm, ids, policy, max_rows=P, prefill_step_size=16)
    plain, r_plain = kvfn.compact(fm, ids, policy, prefill_step_size=16)
    # (the last chunk holds the window: other chunk ends, the same rows to float error)
    assert mx.allclose(first_logits(fm, ids, same), first_logits(fm, ids, plain), atol=TOL).item()
    assert (r_same.rows_after, r_same.bytes_after) == (r_plain.rows_after, r_plain.bytes_after)
    assert r.bytes_before == r_plain.bytes_before and r.rows_after == r_plain.rows_after


@pytest.mark.parametrize(
    "policy, max_rows, during, message",
    [
        (dict(compress=True, budget=40), 24, "prefilling", "duo cannot evict while prefilling: "
         "duo-snapkv's retrieval heads"),
        ({}, 24, "generating", "duo cannot evict while generating: its streaming heads"),
        ({}, 9, "prefilling", "max_rows must be an int >= duo's sink_tokens \\+ recent \\(and "
         "min_tokens\\) 10, got 9"),
    ],
)  # fmt: skip
def test_what_duo_cannot_bound_is_refused_by_name(fm, policy, max_rows, during, message):
    from tests.test_duo import PATTERN

    duo = kvfn.Duo(retrieval=PATTERN[: len(fm.n_kv_heads)], sink_tokens=2, recent=8, **policy)
    with pytest.raises(ValueError, match=message):
        if during == "prefilling":
            kvfn.compact(fm, prompt(100), duo, max_rows=max_rows)
        else:
            next(kvfn.bounded_decode(fm, mx.array([[5]]), kvfn.compact(fm, prompt(100), duo)[0],
                                     duo, steps=4, interval=8))  # fmt: skip
