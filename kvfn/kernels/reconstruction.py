"""KVzip's reconstruction scores of one chunk, fused, on tensor cores (MLX's CUDA backend).

A reconstruction input's n queries (B, n_heads, n, D) each take a softmax over restricted keys:
the first ``s0`` rows, the chunk's rows [start, end) and the input's own rows up to its own; a
chunk row scores the most weight any query of its head gives it. Two launches, neither writing
anything of size queries x keys: each query's log-sum-exp over the restricted keys (online
maximum and sum), then for each chunk row the maximum over the queries of its logit minus that
log-sum-exp (one exponential at the end: the maximum commutes with it). Both multiply on tensor
cores (mma.sync m16n8k16, float32 accumulators; operands from shared memory by ldmatrix, staged
by cp.async in two steps), float16 / bfloat16 at head_dim 64 or 128; elsewhere the stock ops run
(``kvfn.scores.reconstruction_attention``). Logits are in base 2 (scale * log2(e)).
"""

import math
import os
from contextlib import contextmanager
from functools import lru_cache

import mlx.core as mx

from . import cuda_kernel, on_cuda, source

# KVFN_SCORE_KERNEL=0 turns the CUDA kernels off (the stock ops run everywhere)
ENABLED = os.environ.get("KVFN_SCORE_KERNEL", "1") != "0"
DTYPES = (mx.float16, mx.bfloat16)
DIMS = (64, 128)
LSE_WARPS = 4  # a block of the log-sum-exp kernel: 16 query rows a warp
MAX_WARPS = 4  # a block of the maximum kernel: 16 chunk rows a warp
TILE = 64  # keys (log-sum-exp) or queries (maximum) a staged step
LOG2E = 1.0 / math.log(2.0)

HEADER = source("reconstruction.cuh")

# One block a (sequence, KV head) x 16 W query rows; row r is query r / G of query head
# h G + r % G. Keys are indexed virtually: v < s0 the sinks, then the chunk's m rows from
# `start`, then the input's own rows from `ctx` (own row j seen by query i when j <= i), staged
# TILE at a time for all the block's warps. Writes each row's log-sum-exp (base 2).
LSE_SOURCE = source("reconstruction_lse.cu")

# One block a (sequence, query head) x 16 W chunk rows, looping over the head's n queries
# (TILE at a time, staged for all the block's warps with their log-sum-exps): each chunk row's
# largest logit minus its query's log-sum-exp, raised to a weight once at the end. Every query
# sees every chunk row, so no mask but the queries' count.
MAX_SOURCE = source("reconstruction_max.cu")


@contextmanager
def disabled():
    """Within it the stock ops run everywhere (to compare them with the kernels)."""
    global ENABLED
    before, ENABLED = ENABLED, False
    try:
        yield
    finally:
        ENABLED = before


def applies(queries: mx.array, keys: mx.array) -> bool:
    """Whether ``scores`` runs for these (MLX's CUDA backend, float16 or bfloat16 queries and
    keys alike, head_dim 64 or 128; ``KVFN_SCORE_KERNEL=0`` or ``disabled()`` turns it off)."""
    return (
        ENABLED
        and queries.dtype == keys.dtype
        and keys.dtype in DTYPES
        and keys.shape[-1] in DIMS
        and on_cuda()
    )


def scores(
    queries: mx.array, keys: mx.array, s0: int, start: int, end: int, context: int, scale: float
) -> mx.array:
    """``kvfn.scores.reconstruction_attention`` (its arguments checked there; ``s0`` the sinks
    seen, ``min(sink, start)``) by the two kernels: (B, n_heads, end - start) float32. Only
    where ``applies`` says so."""
    if not applies(queries, keys):
        raise RuntimeError(
            f"the reconstruction kernels do not apply to {queries.dtype} queries over "
            f"{keys.dtype} keys of head_dim {keys.shape[-1]} here: they need MLX's CUDA backend, "
            f"float16 or bfloat16, head_dim 64 or 128, and not disabled (KVFN_SCORE_KERNEL=0)"
        )
    B, n_heads, n, D = queries.shape
    n_kv, capacity = keys.shape[1], keys.shape[2]
    group, m = n_heads // n_kv, end - start
    dims = mx.array([n, s0, start, m, context, capacity, n_kv], mx.int32)
    qscale = mx.array([scale * LOG2E], mx.float32)
    template = [("T", keys.dtype), ("D", D), ("G", group), ("TILE", TILE)]
    row_blocks = -(-n * group // (16 * LSE_WARPS))
    (lse,) = _lse_kernel(D)(
        inputs=[queries, keys, dims, qscale],
        template=[*template, ("W", LSE_WARPS)],
        grid=(row_blocks * 32 * LSE_WARPS, B * n_kv, 1),
        threadgroup=(32 * LSE_WARPS, 1, 1),
        output_shapes=[(B * n_kv * n * group,)],
        output_dtypes=[mx.float32],
    )
    key_blocks = -(-m // (16 * MAX_WARPS))
    (out,) = _max_kernel(D)(
        inputs=[queries, keys, lse, dims, qscale],
        template=[*template, ("W", MAX_WARPS)],
        grid=(key_blocks * 32 * MAX_WARPS, B * n_heads, 1),
        threadgroup=(32 * MAX_WARPS, 1, 1),
        output_shapes=[(B, n_heads, m)],
        output_dtypes=[mx.float32],
    )
    return out


def staged_bytes(dim: int, lses: bool = False) -> int:
    """Shared memory a block stages in: two steps of ``TILE`` rows of ``dim`` 2-byte elements
    (and, for the maximum kernel, their log-sum-exps)."""
    return 2 * TILE * dim * 2 + (2 * TILE * 4 if lses else 0)


@lru_cache(maxsize=None)
def _lse_kernel(dim: int):
    return cuda_kernel("kvfn_reconstruction_lse", ["q", "k", "dims", "scale"], ["lse"],
                       LSE_SOURCE, HEADER, shared_memory=staged_bytes(dim))  # fmt: skip


@lru_cache(maxsize=None)
def _max_kernel(dim: int):
    return cuda_kernel("kvfn_reconstruction_max", ["q", "k", "lse", "dims", "scale"], ["out"],
                       MAX_SOURCE, HEADER, shared_memory=staged_bytes(dim, lses=True))  # fmt: skip
