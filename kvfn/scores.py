"""The observation window's attention, reduced to one score per key, inside the prefill; KVzip's
reconstruction scores of one chunk, inside its pass."""

import chex
import mlx.core as mx
from typeguard import typechecked

from .kernels import reconstruction as reconstruction_kernel
from .kernels import window as window_kernel
from .states.cache import State


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
    CUDA, only their logits in the keys' dtype: ``kvfn.kernels.window``)."""
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


@typechecked
def reconstruction_attention(
    queries: mx.array,
    keys: mx.array,
    sink: int,
    start: int,
    end: int,
    context: int,
    scale: float,
    piece: int = 64,
) -> mx.array:
    """KVzip's scores of the context rows [start, end) from one reconstruction input:
    (B, n_heads, end - start) float32. ``queries`` (B, n_heads, n, D; after RoPE) are the
    input's n rows, whose keys are ``keys[:, :, context : context + n]`` (B, n_kv, capacity, D)
    after ``context`` prefilled rows. Each query's softmax runs over the restricted keys: rows
    [0, min(sink, start)), [start, end) and the input's own rows up to its own (causal); a row of
    [start, end) scores the most weight any query gives it. On CUDA the fused kernels run
    (``kvfn.kernels.reconstruction``); elsewhere the stock ops, ``piece`` queries at a time in two
    passes (each query's log-sum-exp, then the weights), so at most (n_heads x piece x keys)
    float32 logits exist at once."""
    chex.assert_rank([queries, keys], 4)
    B, n_heads, n, D = queries.shape
    n_kv = keys.shape[1]
    if n_heads % n_kv or keys.shape[0] != B or keys.shape[3] != D:
        raise ValueError(f"queries {queries.shape} do not fit keys {keys.shape}")
    if sink < 0 or not 0 <= start < end <= context or context + n > keys.shape[2]:
        raise ValueError(
            f"rows [{start}, {end}) with sink {sink} and the input's {n} rows after {context} do "
            f"not fit keys of {keys.shape[2]} rows"
        )
    if piece < 1:
        raise ValueError(f"piece must be >= 1, got {piece}")
    s0 = min(sink, start)
    if reconstruction_kernel.applies(queries, keys):
        return reconstruction_kernel.scores(queries, keys, s0, start, end, context, scale)
    own = keys[:, :, context : context + n]
    restricted = mx.concatenate([keys[:, :, :s0], keys[:, :, start:end], own], axis=2)
    k = restricted.astype(mx.float32)[:, :, None].swapaxes(-1, -2)  # (B, n_kv, 1, D, keys)
    q = (queries.astype(mx.float32) * scale).reshape(B, n_kv, n_heads // n_kv, n, D)
    fixed = s0 + end - start  # keys every query sees
    lse = []
    for i in range(0, n, piece):
        logits = q[:, :, :, i : i + piece] @ k
        rows = mx.arange(i, min(i + piece, n))[:, None]
        seen = mx.arange(restricted.shape[2])[None] < fixed + 1 + rows  # own row j <= query i
        lse.append(mx.logsumexp(mx.where(seen, logits, -mx.inf), axis=-1, keepdims=True))
    lse = mx.concatenate(lse, axis=-2)
    chunk = k[..., s0:fixed]
    best = None
    for i in range(0, n, piece):
        weights = mx.exp(q[:, :, :, i : i + piece] @ chunk - lse[:, :, :, i : i + piece])
        top = mx.max(weights, axis=-2)
        best = top if best is None else mx.maximum(best, top)
    return best.reshape(B, n_heads, end - start)


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
