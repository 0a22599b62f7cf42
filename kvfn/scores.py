"""The observation window's attention, reduced to one score per key, inside the prefill."""

import chex
import mlx.core as mx
from typeguard import typechecked

from .cache import State


@typechecked
def window_attention_scores(
    queries: mx.array, query_positions: mx.array, state: State, scale: float, reduce: bool = True
) -> mx.array:
    """Summed softmax attention of ``queries`` (B, n_heads, w, D; after RoPE) over every slot of
    ``state``: (B, n_heads, capacity), float32; with ``reduce=False`` each query's row
    (B, n_heads, w, capacity). Causal over true positions; O(w x capacity)."""
    chex.assert_rank([queries, query_positions], [4, 2])
    B, n_heads, w, D = queries.shape
    n_kv = state.keys.shape[1]
    if n_heads % n_kv:
        raise ValueError(f"{n_heads} query heads do not group over {n_kv} KV heads")
    # in the keys' dtype (accumulated in float32 by the matmul): no float32 copy of the keys
    q = (queries * scale).astype(state.keys.dtype).reshape(B, n_kv, n_heads // n_kv, w, D)
    k = state.keys[:, :, None]  # (B, n_kv, 1, C, D)
    logits = (q @ k.swapaxes(-1, -2)).astype(mx.float32)  # (B, n_kv, rep, w, C)
    visible = state.positions[:, :, None, None, :] <= query_positions[:, None, None, :, None]
    logits = mx.where(visible, logits, -mx.inf)
    weights = mx.softmax(logits, axis=-1, precise=True)
    if not reduce:
        return weights.reshape(B, n_heads, w, -1)
    return mx.sum(weights, axis=-2).reshape(B, n_heads, -1)
