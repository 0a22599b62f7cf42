"""Every prompt its own length: no trace on the request path for a prompt length not seen before.

``fm.traces`` counts the traces of the compiled steps (``fm.decode``, ``fm.step``). A decode step
rounds a state's capacity up to a ``kvfn.wrapper.bucket`` (multiples of 256 rows to 1024, then
four an octave), so prompts of lengths inside one bucket decode through one trace, and a decode loop traces once a growth
(O(log steps)); the compaction runs eagerly unless asked to compile (a trace per length).
"""

import math

import mlx.core as mx
import pytest

import kvfn
from kvfn import slots as sl
from kvfn.policies.policy import POLICIES as REGISTRY
from kvfn.wrapper import GROWTH, bucket
from tests.test_duo import PATTERN
from tests.tiny import tiny_model

LIBRARY = sorted(n for n, cls in REGISTRY.items() if cls.__module__.startswith("kvfn.policies."))


def policy_of(name: str, fm):
    if name == "duo":
        return kvfn.Duo(retrieval=PATTERN[: len(fm.n_kv_heads)], sink_tokens=2, recent=8)
    settings = dict(budget=16, window=4, sink_tokens=2)
    if name == "streaming":
        settings.pop("window")
    return kvfn.parse_policy(name, **settings)


def greedy(fm, states, token: int, steps: int):
    token = mx.array([[token]])
    for _ in range(steps):
        logits, states = fm.decode(token, states)
        token = mx.argmax(logits, axis=-1)[:, None]
    mx.eval(token)
    return states


@pytest.fixture(scope="module")
def fm():
    return kvfn.FunctionalModel(tiny_model("llama"))


@pytest.mark.parametrize("name", LIBRARY)
def test_prompts_of_new_lengths_decode_without_a_trace(fm, name):
    """20 prompts of distinct lengths inside one bucket: after the first, compacting and
    decoding them traces nothing."""
    policy = policy_of(name, fm)
    traces = []
    for i, length in enumerate(range(40, 100, 3)):  # 20 lengths
        ids = [(7 * j + i) % 90 + 3 for j in range(length)]
        before = fm.traces
        states, _ = kvfn.compact(fm, ids, policy, max_new_tokens=4)
        greedy(fm, states, ids[-1], 6)
        traces.append(fm.traces - before)
    assert len(traces) == 20 and sum(traces[1:]) == 0, traces


@pytest.mark.parametrize("name", LIBRARY)
def test_a_shapes_first_steps_run_eagerly_and_equal_the_compiled_ones(fm, name):
    """``compile_after=3``: the first three decode steps at a layout and shapes run the step's
    function eagerly (no trace) and give the compiled step's logits; the fourth traces."""
    ids = [(5 * j + 1) % 90 + 3 for j in range(70)]
    policy = policy_of(name, fm)
    lazy = kvfn.FunctionalModel(fm.model, compile_after=3)
    states, _ = kvfn.compact(fm, ids, policy, max_new_tokens=8)
    cold, _ = kvfn.compact(lazy, ids, policy, max_new_tokens=8)
    token = cold_token = mx.array([[ids[-1]]])
    traces = []
    for _ in range(5):
        logits, states = fm.decode(token, states)
        cold_logits, cold = lazy.decode(cold_token, cold)
        traces.append(lazy.traces)
        assert mx.allclose(cold_logits, logits, atol=1e-5).item()
        token, cold_token = (
            mx.argmax(logits, axis=-1)[:, None],
            mx.argmax(cold_logits, axis=-1)[:, None],
        )
    assert traces == [0, 0, 0, 1, 1], traces


@pytest.mark.parametrize("bad", [-1, True, 1.5, "8"])
def test_a_bad_compile_after_is_refused_by_value(fm, bad):
    """(A float or a string meets typeguard's check of the annotation first under the tests.)"""
    if isinstance(bad, int):
        message, error = f"compile_after must be an int >= 0, got {bad!r}", ValueError
    else:
        message, error = "compile_after", Exception
    with pytest.raises(error, match=message):
        kvfn.FunctionalModel(fm.model, compile_after=bad)


def test_a_full_prompt_of_a_new_length_decodes_without_a_trace(fm):
    traces = []
    for length in range(40, 100, 3):
        ids = mx.array([[(5 * j) % 90 + 3 for j in range(length)]])
        states = kvfn.prefill(fm, ids[:, :-1], capacity=length + 8)
        before = fm.traces
        greedy(fm, states, int(ids[0, -1].item()), 4)
        traces.append(fm.traces - before)
    assert sum(traces[1:]) == 0, traces


def test_the_compaction_compiles_nothing_unless_asked(fm, monkeypatch):
    compiled = []
    real = mx.compile
    monkeypatch.setattr(mx, "compile", lambda fn, *a, **k: compiled.append(fn) or real(fn, *a, **k))
    ids = [j % 90 + 3 for j in range(57)]
    kvfn.compact(fm, ids, kvfn.SnapKV(budget=16, window=4, sink_tokens=2))
    assert compiled == []
    kvfn.compact(fm, ids, kvfn.SnapKV(budget=16, window=4, sink_tokens=2), compiled=True)
    assert len(compiled) == 1


def kinds(fm):
    """One state of every kind, compacted from one prompt: plain, ragged, head parts (with a
    streaming ring), slots."""
    ids = list(range(3, 50))
    plain, _ = kvfn.compact(fm, ids, kvfn.SnapKV(budget=16, window=4, sink_tokens=2))
    ragged, _ = kvfn.compact(fm, ids, kvfn.AdaKV(budget=16, window=4, sink_tokens=2))
    parts, _ = kvfn.compact(fm, ids, policy_of("duo", fm))
    return {"plain": plain, "ragged": ragged, "parts": parts,
            "slots": sl.pack_layers(parts)}  # fmt: skip


@pytest.mark.parametrize("kind", ["plain", "ragged", "parts", "slots"])
def test_a_300_step_decode_loop_traces_once_a_growth(kind):
    """A decode loop traces when its capacity grows (doubling, in buckets), never per step: a
    loop that retraced each step fails here."""
    fm = kvfn.FunctionalModel(tiny_model("llama"))  # its own: no trace from another test
    states = kinds(fm)[kind]
    before = fm.traces
    greedy(fm, states, 5, 300)
    assert 1 <= fm.traces - before <= 1 + math.ceil(math.log2(300 / GROWTH + 1)), fm.traces


def test_buckets_are_few_and_close():
    """A bucket holds its rows with at most 25% to spare past 1024 rows (256-row steps below),
    a bucket is its own bucket and doubles into one, and an octave holds four of them."""
    sizes = {bucket(n) for n in range(1, 1 << 16)}
    for n in range(1, 1 << 16, 7):
        b = bucket(n)
        assert n <= b <= max(-(-n // GROWTH) * GROWTH, int(1.25 * n)), (n, b)
        assert bucket(b) == b and bucket(2 * b) == 2 * b, (n, b)
    for low in (1024, 2048, 1 << 14):
        assert len({s for s in sizes if low < s <= 2 * low}) == 4, low


def test_benchmark_shapes_pairs_each_new_length_with_its_repeat(capsys):
    """The varied-length benchmark: every length after the first runs new then repeated; a
    compacted state's capacity follows the budget, so its new lengths find their bucket warm,
    and the full cache's follows the prompt (lengths 60-120 fit one 256-row bucket here)."""
    from examples import benchmark_shapes

    out = benchmark_shapes.main(["--lengths", "60:120:3", "--policies", "full,snapkv",
                                 "--new-tokens", "3", "--window", "4"])  # fmt: skip
    rows = {r["policy"]: r for r in out}
    assert list(rows) == ["mlx-lm", "full", "snapkv"]
    seen = [L for r in out for L in r["lengths"]]  # each row its own lengths: new to the process
    assert len(seen) == len(set(seen)) == 9 and all(60 <= L < 120 for L in seen)
    assert rows["snapkv"]["warm_new"] == rows["full"]["warm_new"] == 2
    assert rows["snapkv"]["new"]["traces"] == rows["snapkv"]["repeat"]["traces"] == 0
    assert rows["snapkv"]["warm_new_x"] > 0
    assert "warm new/rep" in capsys.readouterr().out


def test_a_fresh_prefill_takes_its_prompts_bucket():
    """Prompts of different lengths in one bucket prefill into states of one capacity, so every
    chunk but the last reads its keys at the same shape and strides (MLX's CUDA backend builds
    an attention graph per shape and strides); an explicit capacity is kept as given, and the
    rows held are the prompt's."""
    fm = kvfn.FunctionalModel(tiny_model("llama"))
    lengths = (290, 333, 401)  # one bucket: 512
    assert len({bucket(n) for n in lengths}) == 1
    for n in lengths:
        tokens = mx.array([[1 + i % 90 for i in range(n)]])
        states = kvfn.prefill(fm, tokens, prefill_step_size=128)
        scored, scores = kvfn.scored_prefill(fm, tokens, window=8, prefill_step_size=128)
        for s in (states[0], scored[0]):
            assert (s.capacity, s.rows.item()) == (bucket(n), n)
        assert scores[0].shape[-1] == bucket(n)
        exact = kvfn.prefill(fm, tokens, capacity=n + 3, prefill_step_size=128)
        assert exact[0].capacity == n + 3
        assert mx.array_equal(exact[0].keys[:, :, :n], states[0].keys[:, :, :n]).item()


@pytest.mark.parametrize("name", ["snapkv", "streaming"])
def test_a_prompt_kept_whole_holds_its_rows_not_its_prefills_bucket(name):
    """A prompt the policy keeps whole is prefilled into its bucket (256 slots here) but kept
    in its rows plus the room asked for, copied out of the bucket's buffer."""
    fm = kvfn.FunctionalModel(tiny_model("llama"))
    policy = kvfn.parse_policy(name, budget=128, window=8)
    ids = [1 + i % 90 for i in range(41)]
    states, _ = kvfn.compact(fm, ids, policy, max_new_tokens=3)
    full = kvfn.prefill(fm, mx.array([ids[:-1]]))
    assert full[0].capacity == 256 and full[0].keys.shape[2] == 256
    for s in states:
        assert (s.capacity, s.keys.shape[2], s.rows.item()) == (40 + 4, 44, 40)
    assert mx.array_equal(states[0].keys[:, :, :40], full[0].keys[:, :, :40]).item()


def attention_shapes(monkeypatch) -> list:
    """A list that every attention from now on adds its (queries, keys) counts to."""
    seen = []
    sdpa = mx.fast.scaled_dot_product_attention

    def recorded(q, k, v, **kwargs):
        seen.append((q.shape[2], k.shape[2]))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", recorded)
    return seen


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_a_padded_last_chunk_attends_in_the_buckets_shapes_and_changes_nothing(family,
                                                                              monkeypatch):  # fmt: skip
    """``padded`` (CUDA's default) runs the last prefill chunk as a full one: every prompt in a
    bucket attends in shapes its longest one already met (no new attention graph for a new
    length), and the states, scores and next logits are the unpadded ones."""
    fm = kvfn.FunctionalModel(tiny_model(family))
    seen = attention_shapes(monkeypatch)
    shapes = {}
    for n in (401, 290, 333):  # one bucket (512): the longest first
        tokens = mx.array([[1 + (7 * i) % 90 for i in range(n)]])
        runs = {}
        for padded in (True, False):
            seen.clear()
            states, scores = kvfn.scored_prefill(fm, tokens, window=8, prefill_step_size=128,
                                                 padded=padded)  # fmt: skip
            shapes[n, padded] = set(seen)
            logits, _ = fm.forward(mx.array([[5]]), states)
            runs[padded] = states, scores, logits
        (padded, p_scores, p_logits), (plain, scores, logits) = runs[True], runs[False]
        for a, b, sa, sb in zip(padded, plain, p_scores, scores):
            assert (a.rows.item(), a.max_rows, a.dense, a.capacity) == (n, n, True, bucket(n))
            assert mx.array_equal(a.offset, b.offset).item()
            assert mx.array_equal(a.positions, b.positions).item()
            assert mx.allclose(a.keys[:, :, :n], b.keys[:, :, :n], atol=1e-5).item()
            assert mx.allclose(a.values[:, :, :n], b.values[:, :, :n], atol=1e-5).item()
            assert mx.allclose(sa, sb, atol=1e-5).item()
        assert mx.allclose(p_logits, logits, atol=1e-4).item()
    assert shapes[290, True] <= shapes[401, True] and shapes[333, True] <= shapes[401, True]
    assert not shapes[290, False] <= shapes[401, False]  # unpadded: a shape of its own
    assert {q for q, _ in shapes[290, True]} == {128}


@pytest.mark.parametrize("name", LIBRARY)
def test_every_policy_compacts_a_padded_prefill_as_an_unpadded_one(fm, name, monkeypatch):
    """What CUDA's padded last chunk leaves past a prompt's rows (the padding's keys, trimmed)
    is seen by no policy: the rows kept, their positions and the tokens decoded are the same.
    On CUDA a chunk's shape picks its matmul kernel, so keys agree only to rounding (2e-4 on an
    H100 here), and Expected Attention's near-tied rows of a random model can differ."""
    if name == "expected" and kvfn.kernels.on_cuda():
        pytest.skip("on CUDA the padded chunk's keys agree to rounding, not bit for bit")
    policy = policy_of(name, fm)
    ids = [(5 * j) % 90 + 3 for j in range(150)]
    runs = []
    for padded in (True, False):
        monkeypatch.setattr(kvfn.passes, "on_cuda", lambda: padded)
        states, result = kvfn.compact(fm, ids, policy, max_new_tokens=4, prefill_step_size=64)
        tokens, token = [], mx.array([[ids[-1]]])
        for _ in range(4):
            logits, states = fm.decode(token, states)
            token = mx.argmax(logits, axis=-1)[:, None]
            tokens.append(token.item())
        runs.append((kvfn.tree.arrays(states), result.rows_after, tokens, logits))
    (a, rows_a, tokens_a, logits_a), (b, rows_b, tokens_b, logits_b) = runs
    assert rows_a == rows_b and tokens_a == tokens_b
    assert mx.allclose(logits_a, logits_b, atol=1e-4).item()
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape
        if mx.issubdtype(x.dtype, mx.integer):
            assert mx.array_equal(x, y).item()


def test_a_decode_pads_ragged_layers_to_the_sizes_of_a_trace_it_has():
    """A ragged layer's slots follow its prompt's allocation, so a new prompt's layers seldom
    all fall in an earlier prompt's buckets. Decode pads them to a trace's sizes the model has
    made when those cost at most ``TRACE_SLACK`` more bytes (else to the layer by layer largest
    of its own and the latest trace's, within the same slack): the same logits and rows, fewer
    traces. A trace's sizes are what the model has decoded at, so the cases run in order."""
    from kvfn.states import ragged
    from kvfn.wrapper import TRACE_SLACK

    fm = kvfn.FunctionalModel(tiny_model("llama"))
    prefilled = kvfn.prefill(fm, mx.array([[1 + (7 * i) % 90 for i in range(40)]]))
    token = mx.array([[5]])

    def sized(slots):  # per layer: a ragged layer of that many slots, or a plain state
        return tuple(
            ragged.padded(ragged.as_ragged(s, room=8), z) if isinstance(z, int) else z
            for s, z in zip(prefilled, slots)
        )

    assert TRACE_SLACK == 0.25  # the cases below: every layer's slot takes the same bytes
    expected = {  # own slots: (traces, slots decoded in)
        (1024, 1280, 1024): (1, (1024, 1280, 1024)),  # the first: its own
        (1280, 1024, 1024): (1, (1280, 1280, 1024)),  # widened to both: 3584 <= 1.25 x 3328
        (1024, 1024, 1024): (0, (1024, 1280, 1024)),  # the cheaper of the two traces it fits
        (256, 256, 256): (1, (256, 256, 256)),  # any trace would cost more than the slack
        (256, 512, 256): (1, (256, 512, 256)),  # widened: its own is the largest of both
        (256, 256, 512): (1, (256, 512, 512)),  # widened: 1280 <= 1.25 x 1024
    }
    first, other = prefilled[0], kvfn.reserve(prefilled[0], 512)  # a plain first layer
    expected[(first, 1024, 1024)] = (1, (None, 1024, 1024))  # no trace of these kinds yet
    expected[(other, 768, 1024)] = (1, (None, 768, 1024))  # nor of this plain layer's shapes
    expected[(first, 768, 1024)] = (0, (None, 1024, 1024))  # 2048 <= 1.25 x 1792
    for own, (traces, slots) in expected.items():
        states = sized(own)
        before = fm.traces
        logits, out = fm.decode(token, states)
        eager, plain = fm.forward(token, states)
        got = tuple(getattr(s, "slots", None) for s in out)
        assert (fm.traces - before, got) == (traces, slots), own
        assert mx.allclose(logits, eager[:, -1], atol=1e-5).item()
        for a, b in zip(out, plain):
            if not isinstance(a, ragged.RaggedKVCache):
                continue
            assert mx.array_equal(a.lengths, b.lengths).item()
            assert mx.array_equal(a.starts, b.starts).item()
            for h in range(a.n_kv_heads):
                for x, y in zip(ragged.head_rows(a, 0, h), ragged.head_rows(b, 0, h)):
                    assert mx.array_equal(x, y).item()


def test_trace_slack_bounds_the_traces_of_prompts_whose_layers_share_rows_anew():
    """AdaKVzip-global's allocation moves rows between layers from prompt to prompt while their
    sum stays put: each prompt's layers a new combination of sizes. ``trace_slack`` is how much
    more memory a decode may give them to run in a trace made before: with none every prompt
    traces; with more the traces stop once the sizes made cover what prompts ask. The logits
    are the unpadded ones either way."""
    import itertools

    from kvfn.states import ragged

    prompts = list(itertools.permutations((256, 512, 768))) + [(512, 512, 512)]  # sum 1536
    made = {}
    for slack in (0, 1.0):
        fm = kvfn.FunctionalModel(tiny_model("llama"), trace_slack=slack)
        prefilled = kvfn.prefill(fm, mx.array([[1 + (7 * i) % 90 for i in range(40)]]))
        token = mx.array([[5]])
        made[slack] = []
        for own in prompts:
            states = tuple(ragged.padded(ragged.as_ragged(s, room=8), z)
                           for s, z in zip(prefilled, own))  # fmt: skip
            before = fm.traces
            logits, _ = fm.decode(token, states)
            made[slack].append(fm.traces - before)
            assert mx.allclose(logits, fm.forward(token, states)[0][:, -1], atol=1e-5).item()
    assert made[0] == [1] * len(prompts)
    assert sum(made[1.0]) <= len(prompts) // 2 + 1 and made[1.0][-2:] == [0, 0], made[1.0]


@pytest.mark.parametrize("bad", [-0.1, True, float("inf")])
def test_a_bad_trace_slack_is_refused_by_value(bad):
    with pytest.raises(ValueError, match=f"trace_slack must be a number >= 0, got {bad!r}"):
        kvfn.FunctionalModel(tiny_model("llama"), trace_slack=bad)


@pytest.mark.parametrize("name", LIBRARY)
def test_a_question_over_a_compacted_context_attends_with_an_additive_mask_on_cuda(fm, name,
                                                                                monkeypatch):  # fmt: skip
    """A prefill over compacted states (a question after a reused context) masks its queries
    per row: on CUDA the mask reaches SDPA as an additive one (a boolean one has no fused kernel
    there and built kernels for each new question length, ~1 s a question on an H100), for
    every kind of state the registry makes, and the states and logits are the boolean mask's."""
    policy = policy_of(name, fm)
    ids = [(5 * j) % 90 + 3 for j in range(150)]
    context, _ = kvfn.compact(fm, ids, policy, max_new_tokens=0, prefill_step_size=64)
    question = mx.array([[(3 * j) % 80 + 7 for j in range(9)]])
    sdpa, masks = mx.fast.scaled_dot_product_attention, []

    def recorded(q, k, v, **kwargs):
        mask = kwargs.get("mask")
        if q.shape[2] > 1 and isinstance(mask, mx.array):
            masks.append(mask.dtype)
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", recorded)
    runs = {}
    for cuda in (True, False):
        monkeypatch.setattr(kvfn.kernels, "additive_masks", lambda: cuda)
        masks.clear()
        states = kvfn.prefill(fm, question, states=context, prefill_step_size=64, padded=False)
        logits, _ = fm.forward(mx.array([[5]]), states)
        runs[cuda] = kvfn.tree.arrays(states), logits, list(masks)
    (a, logits_a, masks_a), (b, logits_b, masks_b) = runs[True], runs[False]
    assert masks_a and mx.bool_ not in masks_a  # every layer's masked attention saw one
    assert masks_b and set(masks_b) == {mx.bool_}
    assert len(a) == len(b) and all(mx.array_equal(x, y).item() for x, y in zip(a, b))
    assert mx.array_equal(logits_a, logits_b).item()


@pytest.mark.parametrize("name", LIBRARY)
def test_a_question_over_a_compacted_context_runs_in_a_query_bucket_and_changes_nothing(
    fm, name, monkeypatch
):
    """``padded`` (CUDA's default) runs a question prefilled over compacted states (a reused
    context's) as a chunk of ``query_bucket`` tokens, trimmed again: questions of different
    lengths attend in one shape (MLX's CUDA backend builds kernels and attention graphs per
    shape: ~1 s a question on an H100, per context), and the rows kept and what is decoded
    after are the unpadded prefill's, for every kind of state the registry makes."""
    policy = policy_of(name, fm)
    ids = [(5 * j) % 90 + 3 for j in range(150)]
    context, _ = kvfn.compact(fm, ids, policy, max_new_tokens=0, prefill_step_size=64)
    sdpa, seen = mx.fast.scaled_dot_product_attention, set()

    def recorded(q, k, v, **kwargs):
        seen.add(q.shape[2])
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", recorded)
    for n in (9, 13):
        question = mx.array([[(3 * j) % 80 + 7 for j in range(n)]])
        runs = {}
        for padded in (True, False):
            seen.clear()
            states = kvfn.prefill(fm, question, states=context, prefill_step_size=64,
                                  padded=padded)  # fmt: skip
            shapes = set(seen)
            rows = [kvfn.eviction.kept(s)[0] for s in states]
            token, steps = mx.array([[5]]), []
            for _ in range(3):
                logits, states = fm.forward(token, states)
                token = mx.argmax(logits[:, -1], axis=-1)[:, None]
                steps.append((logits, token.item()))
            runs[padded] = shapes, rows, steps
        (shapes_a, rows_a, steps_a), (shapes_b, rows_b, steps_b) = runs[True], runs[False]
        rings = name == "duo"  # its streaming heads' ring drops rows as it appends: no padding
        assert shapes_a - {1} == ({n} if rings else {16}) and shapes_b - {1} == {n}
        assert rows_a == rows_b
        for (la, ta), (lb, tb) in zip(steps_a, steps_b):
            assert ta == tb and mx.allclose(la, lb, atol=1e-4).item()
