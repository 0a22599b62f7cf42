"""kvfn.serving.batch: compacted caches under mlx-lm's own BatchGenerator (continuous batching)."""

import copy

import kvfn  # isort: skip
import kvfn_models
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator

from kvfn.serving.interop import BatchCompactedKVCache

STEPS = 10


@pytest.fixture(scope="module")
def smol():
    model, tokenizer = kvfn_models.load()
    return model, tokenizer, kvfn.FunctionalModel(model)


def prompt(tokenizer, words: int, topic: str) -> list[int]:
    text = " ".join(f"{topic} {i} is noted." for i in range(words)) + f" Summarise the {topic}."
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )


def compacted(fm, ids):
    policy = kvfn.parse_policy("snapkv", budget=48, window=8, sink_tokens=4)
    states, _ = kvfn.compact(fm, ids, policy, max_new_tokens=1)
    return kvfn.to_mlx_cache(states)


def alone(model, caches, ids):
    """Greedy tokens from the given caches, one sequence, plain mlx-lm model calls."""
    caches = copy.deepcopy(caches)
    rest = ids
    out = []
    for _ in range(STEPS):
        logits = model(mx.array([rest]), cache=caches)
        out.append(int(mx.argmax(logits[0, -1]).item()))
        rest = out[-1:]
    return out, caches


def batched(model, entries: list, lengths=None, join_at=None) -> tuple[list, list]:
    """Greedy tokens of several (caches, prompt rest) through mlx-lm's BatchGenerator, each
    entry's caches copied first, ``STEPS`` tokens each (or ``lengths``): all at once, or the
    first alone and the rest joining after ``join_at`` steps. Returns each entry's tokens and
    its caches when it finished."""
    lengths = lengths or [STEPS] * len(entries)
    gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4)

    def insert(part: list, max_tokens: list) -> list:
        return gen.insert([rest for _, rest in part], max_tokens=max_tokens,
                          caches=[copy.deepcopy(c) for c, _ in part])  # fmt: skip

    first = len(entries) if join_at is None else 1
    uids = insert(entries[:first], lengths[:first])
    tokens, finals, steps = {}, {}, 0
    while len(finals) < len(entries):
        if steps == join_at:
            uids += insert(entries[1:], lengths[1:])
        for r in gen.next_generated():
            tokens.setdefault(r.uid, []).append(r.token)
            if r.finish_reason is not None:
                finals[r.uid] = r.prompt_cache
        steps += 1
    gen.close()
    return [tokens[u] for u in uids], [finals[u] for u in uids]


def test_merge_then_extract_is_exact(smol):
    model, tokenizer, fm = smol
    a = compacted(fm, prompt(tokenizer, 30, "ships"))
    b = compacted(fm, prompt(tokenizer, 12, "birds"))
    assert a[0].offset > a[0].rows and a[0].rows == b[0].rows  # both compacted, unlike lengths
    short = kvfn.to_mlx_cache(fm.init_states(1, 0))
    short[0].update_and_fetch(*(mx.ones((1, 3, 5, 64)),) * 2)
    batch = BatchCompactedKVCache.merge([a[0], short[0], b[0]])
    assert batch.offset.tolist() == [a[0].offset, 5, b[0].offset]
    for i, c in enumerate([a[0], short[0], b[0]]):
        back = batch.extract(i)
        assert (back.offset, back.rows) == (c.offset, c.rows)
        assert np.array_equal(np.array(back.positions), np.array(c.positions[:, :, : c.rows]))
        assert np.array_equal(np.array(back.keys), np.array(c.keys[:, :, : c.rows]))


def test_batched_decode_equals_each_alone(smol):
    model, tokenizer, fm = smol
    ids_a, ids_b = prompt(tokenizer, 30, "ships"), prompt(tokenizer, 12, "birds")
    ids_c = prompt(tokenizer, 2, "cats")  # short: prefilled inside the batch, uncompacted
    a, b = compacted(fm, ids_a), compacted(fm, ids_b)
    empty = kvfn.to_mlx_cache(fm.init_states(1, 0))
    want_a, end_a = alone(model, a, ids_a[-1:])
    want_b, end_b = alone(model, b, ids_b[-1:])
    want_c, end_c = alone(model, empty, ids_c)
    got, finals = batched(model, [(a, ids_a[-1:]), (b, ids_b[-1:]), (empty, ids_c)])
    assert got == [want_a, want_b, want_c]
    for final, end in zip(finals, (end_a, end_b, end_c)):
        assert all(isinstance(c, kvfn.CompactedKVCache) for c in final)
        # the batch has also fed its last sampled token (it computes one step ahead)
        r, offset = end[0].rows, end[0].offset
        assert (final[0].offset, final[0].rows) == (offset + 1, r + 1)
        positions = np.array(final[0].positions)
        assert np.array_equal(positions[:, :, :r], np.array(end[0].positions[:, :, :r]))
        assert (positions[:, :, r] == offset).all()


def test_merge_refuses_a_plain_cache(smol):
    from mlx_lm.models.cache import KVCache

    with pytest.raises(TypeError, match="KVCache"):
        BatchCompactedKVCache.merge([KVCache()])


# -- per-head states (DuoAttention) in mlx-lm's batching ------------------------------------------
def duo_policy(fm) -> kvfn.Duo:
    """Retrieval heads at random, plus a layer of only retrieval and one of only streaming heads
    (one part each)."""
    rng = np.random.default_rng(3)
    heads = [list(rng.random(h) < 0.4) for h in fm.n_kv_heads]
    heads[0] = [True] * fm.n_kv_heads[0]
    heads[1] = [False] * fm.n_kv_heads[1]
    return kvfn.Duo(retrieval=tuple(tuple(bool(x) for x in r) for r in heads), sink_tokens=4,
                    recent=40)  # fmt: skip


def kvfn_duo_decode(fm, ids, policy):
    """Greedy tokens and logits of kvfn's own decode over a Duo-compacted prompt (oracle-tested
    in test_duo), and the compacted states."""
    states, _ = kvfn.compact(fm, ids, policy, max_new_tokens=STEPS + 1)
    first, tokens, logits = states, [], []
    token = ids[-1]
    for _ in range(STEPS):
        out, states = fm.decode(mx.array([[token]]), states)
        logits.append(out.reshape(-1))
        token = int(mx.argmax(logits[-1]).item())
        tokens.append(token)
    return tokens, logits, first


def head_parts(policy, states):
    from kvfn.serving.batch import HeadPartsKVCache

    return [HeadPartsKVCache.from_state(s, policy.head_parts(i, len(policy.heads[i])))
            for i, s in enumerate(states)]  # fmt: skip


def test_duo_batched_decode_equals_kvfn_decode(smol):
    from kvfn.serving.batch import HeadPartsKVCache
    from kvfn.wrapper import attending_copy

    model, tokenizer, fm = smol
    policy = duo_policy(fm)
    prompts = [
        prompt(tokenizer, 30, "ships"),
        prompt(tokenizer, 12, "birds"),
        prompt(tokenizer, 0, "cats"),
    ]
    assert len(prompts[2]) - 1 <= policy.sink_tokens + policy.recent < len(prompts[1]) - 1
    entries, want = [], []
    for ids in prompts:
        tokens, _, states = kvfn_duo_decode(fm, ids, policy)
        entries.append((head_parts(policy, states), ids[-1:]))
        want.append(tokens)
    # the streaming parts of the compacted prompts hold sinks + recent rows, the short one all
    assert entries[0][0][1].parts[0].rows == 44 and entries[0][0][1].rings == [(4, 40)]
    assert entries[2][0][1].rings == [None]
    full = kvfn.prefill(fm, mx.array([prompts[0][:-1]]))
    assert entries[0][0][2].nbytes < 0.5 * kvfn.to_mlx_cache(full)[2].nbytes
    got, finals = batched(attending_copy(model), entries)
    assert got == want
    assert all(isinstance(c, HeadPartsKVCache) for c in finals[0])
    assert finals[0][1].offset == len(prompts[0]) + STEPS  # one step ahead, as above


@pytest.mark.parametrize("windowed", [True, False])
def test_duo_batched_logits_equal_kvfn(smol, windowed):
    """Logits of two sequences stepped together through the batch cache equal kvfn's decode of
    each; without the window mask (negative control) the streaming heads read rows their ring
    dropped and the logits differ."""
    from kvfn.serving.batch import BatchHeadPartsKVCache
    from kvfn.wrapper import attending_copy

    model, tokenizer, fm = smol
    policy = duo_policy(fm)
    runs = [
        kvfn_duo_decode(fm, prompt(tokenizer, n, t), policy)
        for n, t in ((30, "ships"), (12, "birds"))
    ]
    caches = [head_parts(policy, states) for _, _, states in runs]
    if not windowed:
        for c in (c for layers in caches for c in layers):
            c.rings = [None] * len(c.rings)
    batch = [BatchHeadPartsKVCache.merge(list(layer)) for layer in zip(*caches)]
    copy_ = attending_copy(model)
    last = [prompt(tokenizer, n, t)[-1] for n, t in ((30, "ships"), (12, "birds"))]
    gaps = []
    for step in range(STEPS):
        logits = copy_(mx.array([[t] for t in last]), cache=batch)[:, -1]
        gaps += [mx.abs(logits[i] - runs[i][1][step]).max().item() for i in range(2)]
        last = [runs[i][0][step] for i in range(2)]
    assert (max(gaps) < 1e-3) == windowed, max(gaps)


def test_per_head_batch_caches_leave_no_growing_chain():
    """A token-only batched decode (mlx-lm's BatchGenerator evaluates only tokens) leaves each
    per-head batch cache's part offsets with a bounded graph: only the first part's is read
    (by RoPE), and the others are handles of it."""
    from kvfn.policies.duo import Duo
    from kvfn.serving.batch import BatchHeadPartsKVCache
    from kvfn.wrapper import attending_copy
    from tests.test_duo import PATTERN, _pending
    from tests.tiny import tiny_model

    model = tiny_model("llama")
    fm, copy_ = kvfn.FunctionalModel(model), attending_copy(model)
    ids = np.random.default_rng(4).integers(0, 97, 50).tolist()
    policy = Duo(retrieval=PATTERN, sink_tokens=2, recent=4)
    pending = []
    for steps in (5, 30):
        states, _ = kvfn.compact(fm, ids, policy, max_new_tokens=40)
        batch = [BatchHeadPartsKVCache.merge([c]) for c in head_parts(policy, states)]
        token = mx.array([[ids[-1]]])
        for _ in range(steps):
            token = mx.argmax(copy_(token, cache=batch)[:, -1], axis=-1)[:, None]
            token.item()
        pending.append(_pending([g.offset for b in batch for g in b.parts]))
    assert pending[0] == pending[1], pending


def test_attending_copy_is_the_model_for_plain_caches(smol):
    from mlx_lm.models.cache import make_prompt_cache

    from kvfn.wrapper import attending_copy

    model, tokenizer, _ = smol
    ids = mx.array([prompt(tokenizer, 3, "cats")])
    want = model(ids, cache=make_prompt_cache(model))
    got = attending_copy(model)(ids, cache=make_prompt_cache(model))
    assert mx.array_equal(want, got).item()
    assert (
        type(model.layers[0].self_attn).__call__
        is not type(attending_copy(model).layers[0].self_attn).__call__
    )


# -- ragged states (Ada-KV, AdaKVzip) in mlx-lm's batching ----------------------------------------
def kvfn_decode(fm, ids, states, steps=STEPS):
    tokens, token = [], ids[-1]
    for _ in range(steps):
        out, states = fm.decode(mx.array([[token]]), states)
        token = int(mx.argmax(out.reshape(-1)).item())
        tokens.append(token)
    return tokens


def test_ragged_batched_decode_equals_kvfn_decode(smol):
    """Prompts compacted by AdaKV (and one kept whole) decode through mlx-lm's BatchGenerator
    and one ``StateCache`` a layer as kvfn decodes each alone; they join and leave the batch at
    different steps (extend, filter), and a layer grows past its room."""
    from kvfn.serving.shell import StateCache
    from kvfn.states.ragged import as_ragged
    from kvfn.wrapper import attending_copy

    model, tokenizer, fm = smol
    policy = kvfn.AdaKV(budget=40, window=8, sink_tokens=4)
    prompts = [prompt(tokenizer, 30, "ships"), prompt(tokenizer, 12, "birds")]
    entries, want = [], []
    for ids in prompts:
        states, _ = kvfn.compact(fm, ids, policy, max_new_tokens=2)  # room 3: grows in the batch
        assert isinstance(states[0], kvfn.RaggedKVCache)
        want.append(kvfn_decode(fm, ids, states))
        entries.append(([StateCache(as_ragged(s)) for s in states], ids[-1:]))
    short = prompt(tokenizer, 1, "cats")
    full = kvfn.prefill(fm, mx.array([short[:-1]]), capacity=len(short))
    want.append(kvfn_decode(fm, short, full))
    entries.append(([StateCache(as_ragged(s)) for s in full], short[-1:]))
    lengths = [STEPS, STEPS - 4, STEPS]
    tokens, finals = batched(attending_copy(model), entries, lengths, join_at=2)
    assert tokens == [w[:n] for w, n in zip(want, lengths)]
    assert all(isinstance(c.layer_state, kvfn.RaggedKVCache) for c in finals[0])
    with pytest.raises(TypeError, match="cannot batch"):
        StateCache.merge([entries[0][0][0], compacted(fm, prompts[0])[0]])
    with pytest.raises(TypeError, match="different kinds"):
        StateCache.merge([entries[0][0][0], StateCache(compacted(fm, prompts[0])[0].to_state())])
