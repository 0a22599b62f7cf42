"""The window queries' softmax reduced over the queries, fused, on MLX's CUDA backend.

``reduced_softmax`` takes the window queries' logits over every slot, in the keys' dtype, and
returns each slot's attention summed (SnapKV's window) or maxed (KVzip's reconstruction) over
the queries, in float32, as the stock ops do (cast, causal mask, softmax, sum or max;
``kvfn.scores``), in two launches: each query's log-sum-exp (its maximum, then its sum, over
the slots it sees), then each slot's reduction. They read the logits three times and write
nothing of their size, where the stock ops make several float32 arrays of (heads x queries x
capacity) a layer, which pile up in a prefill while the host runs layers ahead of the GPU.
"""

import os
from contextlib import contextmanager
from functools import lru_cache

import mlx.core as mx

from . import KERNEL_DTYPES, cuda_kernel, on_cuda, source

# KVFN_SCORE_KERNEL=0 turns the CUDA kernels off (the stock ops run everywhere)
ENABLED = os.environ.get("KVFN_SCORE_KERNEL", "1") != "0"
THREADS = 256

HEADER = source("window.cuh")

# One block a query row (sequence b, KV head, group member, query q) of logits (C slots):
# the log-sum-exp over the slots it sees (position <= its own); -inf where it sees none.
LSE_SOURCE = source("window_lse.cu")

# One thread a slot c of one (sequence, KV head, group member): its softmax weight summed over
# the W queries that see it, or (MAX) their largest.
REDUCE_SOURCE = source("window_reduce.cu")


OPS = ("sum", "max")


@contextmanager
def disabled():
    """Within it the stock ops run everywhere (to compare them with the kernels). It acts on
    what runs or is traced inside it: a step ``mx.compile`` traced before keeps its kernels."""
    global ENABLED
    before, ENABLED = ENABLED, False
    try:
        yield
    finally:
        ENABLED = before


def applies(logits: mx.array) -> bool:
    """Whether ``reduced_softmax`` runs for these logits (MLX's CUDA backend, a floating dtype;
    ``KVFN_SCORE_KERNEL=0`` or ``disabled()`` turns it off)."""
    return ENABLED and logits.dtype in KERNEL_DTYPES and on_cuda()


def reduced_softmax(
    logits: mx.array, key_positions: mx.array, query_positions: mx.array, op: str = "sum"
) -> mx.array:
    """Softmax over the slots of each query's ``logits`` (B, n_kv, group, w, C), masked to the
    slots whose ``key_positions`` (B, n_kv or 1, C) are at most the query's
    ``query_positions`` (B or 1, w), then summed (``op="sum"``) or maxed (``"max"``) over the
    queries: (B, n_kv, group, C) float32. A query that sees no slot adds nothing. Only where
    ``applies`` says so."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if logits.ndim != 5 or 0 in logits.shape:
        raise ValueError(f"logits must be (B, n_kv, group, w >= 1, C >= 1), got {logits.shape}")
    B, n_kv, group, w, C = logits.shape
    if key_positions.shape not in ((B, n_kv, C), (B, 1, C)) or query_positions.shape not in (
        (B, w),
        (1, w),
    ):
        raise ValueError(
            f"positions {key_positions.shape} and {query_positions.shape} do not fit logits "
            f"{logits.shape}"
        )
    if not applies(logits):
        raise RuntimeError(
            f"the window kernels do not apply to {logits.dtype} logits here: they need MLX's "
            "CUDA backend, a floating dtype, and not disabled (KVFN_SCORE_KERNEL=0, disabled())"
        )
    rows = B * n_kv * group
    if rows * w * THREADS >= 2**31 or rows >= 2**16:  # CUDA's grid limits
        raise ValueError(f"{rows} x {w} query rows are too many for one launch")
    kpos = mx.broadcast_to(key_positions, (B, n_kv, C)).astype(mx.int32)
    qpos = mx.broadcast_to(query_positions, (B, w)).astype(mx.int32)
    dims = mx.array([C, w, group, n_kv], dtype=mx.int32)
    (lse,) = _lse_kernel()(
        inputs=[logits, kpos, qpos, dims],
        template=[("T", logits.dtype)],
        grid=(rows * w * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows * w,)],
        output_dtypes=[mx.float32],
    )
    (out,) = _reduce_kernel()(
        inputs=[logits, kpos, qpos, dims, lse],
        template=[("T", logits.dtype), ("MAX", op == "max")],
        grid=(-(-C // THREADS) * THREADS, rows, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, n_kv, group, C)],
        output_dtypes=[mx.float32],
    )
    return out


@lru_cache(maxsize=None)
def _lse_kernel():
    return cuda_kernel("kvfn_window_lse", ["logits", "kpos", "qpos", "dims"], ["lse"], LSE_SOURCE,
                       HEADER)  # fmt: skip


@lru_cache(maxsize=None)
def _reduce_kernel():
    return cuda_kernel("kvfn_window_reduce", ["logits", "kpos", "qpos", "dims", "lse"], ["out"],
                       REDUCE_SOURCE, HEADER)  # fmt: skip
