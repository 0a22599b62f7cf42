"""A compacted state in mlx-lm's own generate, speculative decoding, and prompt-cache files."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step, stream_generate
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, make_prompt_cache, save_prompt_cache

from kvfn import FunctionalModel
from kvfn import cache as kv
from kvfn import compact_prompt_cache
from kvfn.serving.interop import CompactedKVCache, from_mlx_cache, load_prompt_cache, to_mlx_cache

STEPS = 12


@pytest.fixture(scope="module")
def compacted(smollm2):
    model, tokenizer = smollm2
    fm = FunctionalModel(model)
    text = "Paris is the capital of France. " * 10 + "Berlin is the capital of Germany. " * 10
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text + "What is the capital of France?"}],
        add_generation_prompt=True,
    )
    states, _ = compact_prompt_cache(fm, ids, budget=64, window=16, max_new_tokens=STEPS)
    token, ours = mx.array([[ids[-1]]]), []
    decoded = states
    for _ in range(STEPS):
        logits, decoded = fm.decode(token, decoded)
        token = mx.argmax(logits, -1)[:, None]
        ours.append(token.item())
    return fm, ids, states, ours


def mlx_lm_tokens(model, last, caches, **kw):
    steps = generate_step(mx.array([last]), model, prompt_cache=caches, max_tokens=STEPS, **kw)
    return [int(t) for t, _ in steps]


def test_mlx_lm_generate_from_a_compacted_cache(smollm2, compacted):
    model, _ = smollm2
    _, ids, states, ours = compacted
    caches = to_mlx_cache(states)
    assert caches[0].offset == len(ids) - 1 and caches[0].size() == 64
    assert mlx_lm_tokens(model, ids[-1], caches) == ours
    assert caches[0].offset >= len(ids) - 1 + STEPS  # generate_step runs one step ahead


def test_prompt_cache_file_round_trip(smollm2, compacted, tmp_path):
    model, _ = smollm2
    _, ids, states, ours = compacted
    path = str(tmp_path / "prompt.safetensors")
    save_prompt_cache(path, to_mlx_cache(states), metadata={"kvfn": "snapkv"})
    loaded, meta = load_prompt_cache(path, return_metadata=True)
    assert meta["kvfn"] == "snapkv"
    assert all(type(c) is CompactedKVCache for c in loaded)
    assert loaded[5].offset == len(ids) - 1 and loaded[5].size() == 64
    assert np.array_equal(np.array(loaded[5].positions), np.array(states[5].positions)[:, :, :64])
    back = from_mlx_cache(loaded, capacity=64 + STEPS + 1)
    assert np.array_equal(np.array(back[7].positions), np.array(states[7].positions))
    assert mlx_lm_tokens(model, ids[-1], loaded) == ours


def test_speculative_decoding_gives_the_same_greedy_tokens(smollm2, compacted):
    model, tokenizer = smollm2
    _, ids, states, ours = compacted
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                           vocab_size=model.args.vocab_size)  # fmt: skip
    mx.random.seed(0)
    draft = llama.Model(args)  # a poor draft: most proposals are rejected and rolled back
    draft_cache = make_prompt_cache(draft)
    draft(mx.array([ids[:-1]]), cache=draft_cache)
    caches = to_mlx_cache(states) + draft_cache
    out = [
        r.token
        for r in stream_generate(model, tokenizer, mx.array([ids[-1]]), max_tokens=STEPS,
                                 draft_model=draft, prompt_cache=caches, num_draft_tokens=3)  # fmt: skip
    ]
    eos = tokenizer.eos_token_id
    assert out == (ours[: ours.index(eos) + 1] if eos in ours else ours)  # stops at EOS
    assert len(out) >= 6


def test_trim_removes_only_a_contiguous_tail():
    s = kv.from_full(mx.ones((1, 1, 6, 2)), mx.ones((1, 1, 6, 2)))
    s = kv.evict(s, mx.array([[[0, 1, 4, 5]]]))
    (c,) = to_mlx_cache([s])
    c.update_and_fetch(mx.ones((1, 1, 2, 2)), mx.ones((1, 1, 2, 2)))
    assert c.contiguous_tail() == 4 and c.offset == 8
    assert c.trim(1) == 1 and c.offset == 7 and c.size() == 5
    assert c.trim(10) == 3 and c.offset == 4 and c.size() == 2  # rows 0, 1 stay: 2, 3 were evicted


def test_interop_rejects_what_mlx_lm_cannot_hold():
    s = kv.from_full(mx.ones((2, 1, 3, 2)), mx.ones((2, 1, 3, 2)))
    with pytest.raises(ValueError, match="batch size 1, got 2"):
        to_mlx_cache([s])
    holes = kv.restrict(
        kv.from_full(mx.ones((1, 2, 3, 2)), mx.ones((1, 2, 3, 2))), mx.array([[[0, 2], [1, 2]]])
    )
    with pytest.raises(ValueError, match="empty rows among its first 3"):
        to_mlx_cache([holes])
    with pytest.raises(TypeError, match="cannot convert a str"):
        from_mlx_cache(["not a cache"])
    plain = KVCache()
    plain.update_and_fetch(mx.ones((1, 1, 3, 2)), mx.ones((1, 1, 3, 2)))
    assert from_mlx_cache([plain])[0].offset.item() == 3


def test_quantized_compacted_cache_equals_mlx_lm_quantized_cache(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer.encode("A short history of the lighthouse keepers of the northern coast. " * 6)
    plain = make_prompt_cache(model)
    model(mx.array([ids[:-1]]), cache=plain)
    ours = [c.to_quantized(group_size=64, bits=4) for c in to_mlx_cache(from_mlx_cache(plain))]
    theirs = [c.to_quantized(group_size=64, bits=4) for c in plain]
    assert type(ours[0]).__name__ == "QuantizedCompactedKVCache" and ours[0].bits == 4
    for a, b in zip(ours[3].state[0], theirs[3].state[0]):
        assert np.array_equal(np.array(a), np.array(b)[:, :, : len(ids) - 1])
    assert ours[0].kv_nbytes == sum(
        x[:, :, : len(ids) - 1].nbytes for x in (*theirs[0].keys, *theirs[0].values)
    )
    token = mx.array([[ids[-1]]])
    for _ in range(4):
        la, lb = model(token, cache=ours)[:, -1], model(token, cache=theirs)[:, -1]
        assert np.array_equal(np.array(la), np.array(lb))
        token = mx.argmax(la, -1)[:, None]


def test_mlx_lm_kv_bits_quantizes_a_compacted_cache(smollm2, compacted):
    model, _ = smollm2
    _, ids, states, _ = compacted
    caches = to_mlx_cache(states)
    by_flag = mlx_lm_tokens(model, ids[-1], caches, kv_bits=8, quantized_kv_start=0)
    assert all(type(c).__name__ == "QuantizedCompactedKVCache" for c in caches)
    grown = caches[0].offset - (len(ids) - 1)  # generate_step runs one step ahead
    assert grown >= STEPS and caches[0].size() == 64 + grown
    by_hand = mlx_lm_tokens(model, ids[-1], [c.to_quantized(bits=8) for c in to_mlx_cache(states)])
    assert by_flag[1:] == by_hand[1:]  # mlx-lm quantizes after its first step


def test_quantized_compacted_cache_file_round_trip_and_trim(smollm2, compacted, tmp_path):
    model, _ = smollm2
    _, ids, states, _ = compacted
    q = [c.to_quantized(bits=4) for c in to_mlx_cache(states)]
    path = str(tmp_path / "q.safetensors")
    save_prompt_cache(path, q)
    loaded = load_prompt_cache(path)
    assert type(loaded[0]).__name__ == "QuantizedCompactedKVCache"
    assert (loaded[0].bits, loaded[0].group_size, loaded[0].offset) == (4, 64, len(ids) - 1)
    reference = [c.to_quantized(bits=4) for c in to_mlx_cache(states)]
    assert mlx_lm_tokens(model, ids[-1], loaded) == mlx_lm_tokens(model, ids[-1], reference)
    rows = loaded[0].size()  # 64 and the generated rows: a contiguous tail
    assert loaded[0].trim(rows - 64) == rows - 64 and loaded[0].size() == 64
    assert loaded[0].nbytes == loaded[0].kv_nbytes + 4 * 3 * 64  # int32 positions, 3 heads


def test_per_head_states_are_refused_by_name():
    """Ragged rows (Ada-KV), head parts (Duo) and slots keep a row count per KV head, which no
    mlx-lm cache object holds: ``to_mlx_cache`` names the kind and what decodes it instead."""
    import kvfn
    from kvfn import slots as sl
    from kvfn.policies.duo import Duo
    from tests.test_duo import PATTERN
    from tests.tiny import tiny_model

    fm = FunctionalModel(tiny_model("llama"))
    ids = list(range(3, 43))
    ragged, _ = kvfn.compact(fm, ids, kvfn.AdaKV(budget=16, window=4, sink_tokens=2))
    parts, _ = kvfn.compact(fm, ids, Duo(retrieval=PATTERN[: len(fm.n_kv_heads)],
                                          sink_tokens=2, recent=6))  # fmt: skip
    slots = sl.pack_layers(parts)
    for states in (ragged, parts, slots):
        kind = next(type(s).__name__ for s in states if type(s) is not kv.State)
        with pytest.raises(ValueError, match=f"a {kind} keeps its rows per KV head.*decode it"):
            to_mlx_cache(states)
    plain, _ = kvfn.compact(fm, ids, kvfn.SnapKV(budget=16, window=4, sink_tokens=2))
    assert len(to_mlx_cache(plain)) == len(plain)
    with pytest.raises(TypeError, match="not a kvfn layer state"):
        to_mlx_cache([plain[0], "layer"])


# -- evicting while mlx-lm generates -------------------------------------------------------------
def bounded_run(fm, ids, states, policy, steps, interval):
    from kvfn import bounded_decode
    from tests.test_bounded import run

    return run(bounded_decode(fm, mx.array([[ids[-1]]]), states, policy, steps=steps,
                              interval=interval))  # fmt: skip


@pytest.fixture(scope="module")
def tiny():
    from kvfn.wrapper import attending_copy
    from tests.tiny import tiny_model

    model = tiny_model("llama")
    return model, attending_copy(model), FunctionalModel(model)


@pytest.mark.parametrize("name", ["snapkv", "streaming", "chunkkv"])
def test_caches_evicting_in_mlx_lm_generate_keep_what_bounded_decode_keeps(tiny, name):
    """The oracle: mlx-lm's own generate over ``to_mlx_cache(states, policy=...)`` (the model as
    ``attending_copy``, so the caches read the queries) gives kvfn.bounded_decode's tokens, holds
    at most budget + interval rows, and keeps the rows it keeps."""
    import kvfn

    model, attending, fm = tiny
    ids = [(7 * j) % 90 + 3 for j in range(100)]
    settings = dict(budget=32) if name == "streaming" else dict(budget=32, window=8)
    policy = kvfn.parse_policy(name, **settings)
    states, _ = kvfn.compact(fm, ids, policy, max_new_tokens=8)
    interval, steps = 40, 130
    want, final = bounded_run(fm, ids, states, policy, steps, interval)
    caches = to_mlx_cache(states, policy=policy, interval=interval)
    got, sizes = [], []
    for token, _ in generate_step(mx.array([ids[-1]]), attending, prompt_cache=caches,
                                  max_tokens=steps):  # fmt: skip
        got.append(int(token))
        sizes.append(caches[0].size())
    assert got == want
    assert max(sizes) <= 32 + interval and min(sizes) <= 33  # it compacted, more than once
    assert sum(b < a for a, b in zip(sizes, sizes[1:])) == 3
    # generate_step runs one step ahead: one more row than bounded_decode's last state holds
    for c, s in zip(caches, final):
        kept = s.positions[0, :, : s.max_rows].tolist()
        assert [row[: len(k)] for row, k in zip(c.positions[0, :, : c.rows].tolist(), kept)] == kept


def test_an_evicting_cache_says_what_it_needs_and_what_it_refuses(tiny):
    import kvfn

    model, _, fm = tiny
    ids = [(7 * j) % 90 + 3 for j in range(100)]
    policy = kvfn.SnapKV(budget=32, window=8)
    states, _ = kvfn.compact(fm, ids, policy, max_new_tokens=8)
    caches = to_mlx_cache(states, policy=policy, interval=40)
    with pytest.raises(ValueError, match=r"kvfn.wrapper.attending_copy\(model\)"):
        list(generate_step(mx.array([ids[-1]]), model, prompt_cache=caches, max_tokens=4))
    streaming = to_mlx_cache(states, policy=kvfn.StreamingLLM(budget=32), interval=40)
    sizes = [streaming[0].size() for _ in generate_step(mx.array([ids[-1]]), model,
                                                        prompt_cache=streaming, max_tokens=90)]  # fmt: skip
    assert max(sizes) <= 72 and min(sizes) <= 33  # it needs no queries: the plain model will do
    with pytest.raises(ValueError, match="kvzip cannot evict while generating"):
        to_mlx_cache(states, policy=kvfn.KVzip(budget=32, window=8))
    with pytest.raises(ValueError, match="interval must be an int > the policy's window 8"):
        to_mlx_cache(states, policy=policy, interval=8)
    with pytest.raises(ValueError, match="evicts while generating is not quantized"):
        to_mlx_cache(states, policy=policy)[0].to_quantized()


def batch_run(model, entries, steps):
    """Greedy tokens of (caches, rest) entries through mlx-lm's BatchGenerator, and the widest
    its running batch's buffer grew."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4)
    uids = gen.insert([rest for _, rest in entries], max_tokens=[steps] * len(entries),
                      caches=[c for c, _ in entries])  # fmt: skip
    got, widest = {u: [] for u in uids}, 0
    while any(len(t) < steps for t in got.values()):
        for r in gen.next_generated():
            got[r.uid].append(r.token)
        layer = gen._generation_batch.prompt_cache  # mlx-lm's running batch: one cache a layer
        if layer and layer[0].keys is not None:
            widest = max(widest, layer[0].keys.shape[2])
    gen.close()
    return [got[u] for u in uids], widest


@pytest.mark.parametrize("with_plain", [True, False])
def test_evicting_sequences_batched_by_mlx_lm_keep_what_each_keeps_alone(tiny, with_plain):
    """Continuous batching (mlx-lm's BatchGenerator over ``BatchCompactedKVCache``): sequences of
    different lengths, each evicting on its own schedule (beside one that does not), give the
    tokens each gives alone (kvfn.bounded_decode; fm.decode for the plain one); evicting alone,
    the batch's buffer holds no more than budget + interval rows and mlx-lm's growth step."""
    import kvfn

    model, attending, fm = tiny
    policy, interval = kvfn.SnapKV(budget=32, window=8), 40
    steps = 110 if with_plain else 300
    lengths = (100, 61, 80) if with_plain else (100, 61)
    entries, want = [], []
    for k, n in enumerate(lengths):
        ids = [(7 * j + k) % 90 + 3 for j in range(n)]
        states, _ = kvfn.compact(fm, ids, policy, max_new_tokens=8)
        if k < 2:
            tokens, _ = bounded_run(fm, ids, states, policy, steps, interval)
            caches = to_mlx_cache(states, policy=policy, interval=interval)
        else:
            token, tokens, s = mx.array([[ids[-1]]]), [], states
            for _ in range(steps):
                logits, s = fm.decode(token, s)
                token = mx.argmax(logits, axis=-1)[:, None]
                tokens.append(token.item())
            caches = to_mlx_cache(states)
        entries.append((caches, ids[-1:]))
        want.append(tokens)
    got, widest = batch_run(attending, entries, steps)
    assert got == want
    if not with_plain:
        assert widest <= 32 + interval + 256 < 33 + steps
