"""The observation window's attention, reduced to one score per key, inside the prefill."""

import chex
import mlx.core as mx
from typeguard import typechecked

from . import window_kernel
from .cache import State


@typechecked
def window_attention_scores(
    queries: mx.array, query_positions: mx.array, state: State, scale: float, reduce: bool = True
) -> mx.array:
    """Summed softmax attention of ``queries`` (B, n_heads, w, D; after RoPE) over every slot of
    ``state``: (B, n_heads, capacity), float32; with ``reduce=False`` each query's row
    (B, n_heads, w, capacity). Causal over true positions (a query that sees no slot adds
    nothing); O(w x capacity)."""
    logits = _logits(queries, query_positions, state, scale)
    B, n_heads, w, _ = queries.shape
    if reduce and window_kernel.applies(logits):
        out = window_kernel.reduced_softmax(logits, state.positions, query_positions)
        return out.reshape(B, n_heads, -1)
    weights = _weights(logits, state.positions, query_positions)
    if not reduce:
        return weights.reshape(B, n_heads, w, -1)
    return mx.sum(weights, axis=-2).reshape(B, n_heads, -1)


@typechecked
def window_attention_max(
    queries: mx.array, query_positions: mx.array, state: State, scale: float, piece: int = 64
) -> mx.array:
    """The most softmax attention any of ``queries`` (B, n_heads, w, D; after RoPE) pays each
    slot of ``state``: (B, n_heads, capacity), float32. Causal over true positions. The queries
    go ``piece`` at a time, so at most (n_heads x piece x capacity) weights exist at once (on
    CUDA, only their logits in the keys' dtype: ``kvfn.window_kernel``)."""
    if piece < 1:
        raise ValueError(f"piece must be >= 1, got {piece}")
    best = None
    for i in range(0, queries.shape[2], piece):
        q, qpos = queries[:, :, i : i + piece], query_positions[:, i : i + piece]
        logits = _logits(q, qpos, state, scale)
        if window_kernel.applies(logits):
            top = window_kernel.reduced_softmax(logits, state.positions, qpos, op="max")
        else:
            top = mx.max(_weights(logits, state.positions, qpos), axis=-2)
        top = top.reshape(q.shape[0], q.shape[1], -1)
        best = top if best is None else mx.maximum(best, top)
    return best


def _logits(queries, query_positions, state, scale) -> mx.array:
    """(B, n_kv, group, w, capacity) in the keys' dtype (accumulated in float32 by the matmul):
    no float32 copy of the keys."""
    chex.assert_rank([queries, query_positions], [4, 2])
    B, n_heads, w, D = queries.shape
    n_kv = state.keys.shape[1]
    if n_heads % n_kv:
        raise ValueError(f"{n_heads} query heads do not group over {n_kv} KV heads")
    q = (queries * scale).astype(state.keys.dtype).reshape(B, n_kv, n_heads // n_kv, w, D)
    return q @ state.keys[:, :, None].swapaxes(-1, -2)


def _weights(logits, key_positions, query_positions) -> mx.array:
    """float32 softmax of ``logits`` over the slots each query sees; zeros where it sees none."""
    visible = key_positions[:, :, None, None, :] <= query_positions[:, None, None, :, None]
    weights = mx.softmax(mx.where(visible, logits.astype(mx.float32), -mx.inf), axis=-1,
                         precise=True)  # fmt: skip
    return mx.where(visible, weights, 0.0)  # a row that sees nothing is NaN before this


def query_moments(batch: int, n_heads: int, head_dim: int) -> mx.array:
    """Empty running moments of a layer's queries, (B, n_heads, head_dim + 2, head_dim) float32:
    per head, row 0 sums the queries, row 1 counts them (every entry), rows 2: sum their outer
    products. ``add_query_moments`` adds queries; ``query_statistics`` reads mean and
    covariance."""
    return mx.zeros((batch, n_heads, head_dim + 2, head_dim), mx.float32)


def add_query_moments(moments: mx.array, queries: mx.array) -> mx.array:
    """``moments`` plus ``queries`` (B, n_heads, n, head_dim), before RoPE."""
    q = queries.astype(mx.float32)
    B, H, n, D = q.shape
    count = mx.full((B, H, 1, D), float(n), mx.float32)
    return moments + mx.concatenate(
        [mx.sum(q, axis=2, keepdims=True), count, q.swapaxes(-1, -2) @ q], axis=2
    )


def query_statistics(moments: mx.array) -> tuple[mx.array, mx.array]:
    """Mean (B, n_heads, D) and covariance (B, n_heads, D, D) of the queries in ``moments``
    (normalized by their count, as a maximum-likelihood estimate)."""
    n = moments[:, :, 1:2, :1]
    if (n < 1).any().item():
        raise ValueError("query moments hold no queries")
    mean = moments[:, :, 0] / n[..., 0]
    cov = moments[:, :, 2:] / n - mean[..., :, None] * mean[..., None, :]
    return mean, cov
