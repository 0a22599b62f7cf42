"""kvfn.batch: compacted caches under mlx-lm's own BatchGenerator (continuous batching)."""

import copy

import kvfn  # isort: skip
import kvfn_models
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator

from kvfn.batch import BatchCompactedKVCache

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


def batched(model, entries):
    """Greedy tokens of several (caches, prompt rest) at once through mlx-lm's BatchGenerator."""
    gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4)
    uids = gen.insert(
        [rest for _, rest in entries],
        max_tokens=[STEPS] * len(entries),
        caches=[copy.deepcopy(c) for c, _ in entries],
    )
    tokens, finals = {u: [] for u in uids}, {}
    while len(finals) < len(uids):
        for r in gen.next_generated():
            tokens[r.uid].append(r.token)
            if r.finish_reason is not None:
                finals[r.uid] = r.prompt_cache
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
