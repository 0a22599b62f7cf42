"""Baseline selection policies next to SnapKV: which prompt rows to keep without scores.

Each returns sorted slot indices (B, n_kv_heads, min(P, budget)) of a prompt of P rows, the
same contract as ``snapkv_keep_indices``, so ``evict_prompt_cache`` takes any of them.
"""

import mlx.core as mx
from typeguard import typechecked


def _check(prompt_length: int, budget: int, sink_tokens: int, recent: int) -> None:
    if prompt_length < 1:
        raise ValueError(f"prompt_length must be >= 1, got {prompt_length}")
    if sink_tokens < 0 or recent < 0:
        raise ValueError(f"sink_tokens and window must be >= 0, got {sink_tokens}, {recent}")
    if budget < sink_tokens + recent or budget < 1:
        raise ValueError(
            f"budget {budget} is below sink_tokens + window = {sink_tokens} + {recent} (or < 1)"
        )


def _whole(prompt_length: int, batch: int, n_kv_heads: int) -> mx.array:
    return mx.broadcast_to(
        mx.arange(prompt_length, dtype=mx.int32), (batch, n_kv_heads, prompt_length)
    )


@typechecked
def recent_keep_indices(
    prompt_length: int, budget: int, *, n_kv_heads: int, batch: int = 1, sink_tokens: int = 4
) -> mx.array:
    """StreamingLLM (arXiv:2309.17453): the first ``sink_tokens`` rows and the most recent
    ``budget - sink_tokens`` rows, as mlx-lm's ``RotatingKVCache(keep=sink_tokens)`` keeps them."""
    _check(prompt_length, budget, sink_tokens, 0)
    if prompt_length <= budget:
        return _whole(prompt_length, batch, n_kv_heads)
    recent = budget - sink_tokens
    idx = mx.concatenate([mx.arange(sink_tokens), mx.arange(prompt_length - recent, prompt_length)])
    return mx.broadcast_to(idx.astype(mx.int32), (batch, n_kv_heads, budget))


@typechecked
def random_keep_indices(
    prompt_length: int,
    budget: int,
    *,
    n_kv_heads: int,
    key: mx.array,
    batch: int = 1,
    sink_tokens: int = 4,
    window: int = 32,
) -> mx.array:
    """SnapKV's sinks and recent window, and the rest of the budget drawn uniformly at random
    from the middle rows (each head its own draw, from the PRNG ``key``): the control that
    tells how much SnapKV's scores add over its fixed rows."""
    _check(prompt_length, budget, sink_tokens, window)
    if prompt_length <= budget:
        return _whole(prompt_length, batch, n_kv_heads)
    n_middle = budget - sink_tokens - window
    fixed = mx.concatenate(
        [mx.arange(sink_tokens), mx.arange(prompt_length - window, prompt_length)]
    ).astype(mx.int32)
    fixed = mx.broadcast_to(fixed, (batch, n_kv_heads, sink_tokens + window))
    if n_middle == 0:
        return mx.sort(fixed, axis=-1)
    noise = mx.random.uniform(shape=(batch, n_kv_heads, prompt_length), key=key)
    pos = mx.arange(prompt_length)
    noise = mx.where((pos >= sink_tokens) & (pos < prompt_length - window), noise, -1.0)
    top = mx.argpartition(-noise, kth=n_middle - 1, axis=-1)[..., :n_middle].astype(mx.int32)
    return mx.sort(mx.concatenate([fixed, top], axis=-1), axis=-1)
