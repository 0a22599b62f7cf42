"""Decode attention over the valid prefix of a fixed-capacity KV state.

``ragged_decode_attention`` attends one query token to the slots ``[0, lengths)`` of each
(batch, KV head). On MLX's CUDA backend it runs a split-K ("flash-decoding") kernel that reads
only the valid rows; elsewhere it falls back to ``mx.fast.scaled_dot_product_attention`` with a
boolean mask. This module imports nothing from kvfn, so it can be loaded by file path.
"""

import hashlib
import math
import os
from functools import lru_cache
from pathlib import Path

import mlx.core as mx

LOG2E = 1.0 / math.log(2.0)
THREADS = 128  # a block of the CUDA-core split kernels: THREADS / 32 warps (W in the sources)
SMS = 132  # multiprocessors of an H100 / H200: the split count aims at a few waves of them
BLOCKS_PER_SM = 3  # resident CUDA-core blocks plan sizes the splits by (139 registers, D=128, U=4)
# a block's fixed cost is about that of 256 rows (the H200, in a decode step: at 1K rows a layer
# 4 splits took 14 us, 19 splits 21 us; profile_timeline.py)
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 256
MAX_HEADS_PER_BLOCK = 8
SHARED_LIMIT = 48 * 1024  # a block's shared memory without the opt-in (and its static limit)
PREFETCH = True
UNROLL = None  # keys a lane group loads per step (U); None: 4 for up to 4 heads a block, else 2
STAGES = 2  # steps of rows in flight through shared memory (cp.async); 0: register prefetch
# KVFN_DECODE_KERNEL=0 turns the CUDA kernel off (every call takes the masked SDPA)
ENABLED = os.environ.get("KVFN_DECODE_KERNEL", "1") != "0"
# KVFN_TWO_PART_KERNEL=0 keeps a head-partitioned layer's decode attention per part
TWO_PART_ENABLED = ENABLED and "0" not in (os.environ.get("KVFN_TWO_PART_KERNEL"),
                                           os.environ.get("KVFN_TWO_GROUP_KERNEL"))  # its old name
KERNEL_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
# The split kernel's tensor-core version (MMA_SPLIT_SOURCE) takes float16 / bfloat16 and head_dim
# 64 or 128 (MMA_DIMS). It runs on head_dim MMA_RUN_DIMS wherever plan's splits for it hold at
# least MMA_MIN_KEYS_PER_SPLIT rows, in blocks of MMA_THREADS (8 warps: at 141 registers a
# thread one block an SM, MMA_BLOCKS_PER_SM). plan gives it splits of at least
# MMA_KEYS_PER_SPLIT rows and MMA_FILL of the SMs' blocks: timed inside decode steps on the H200
# (8B shape, 8 KV heads; profile section 21), 12 splits a layer took 28.6-29.1 / 45.2-45.6 /
# 138.7-138.9 us at 16K / 32K / 128K rows against 31.8-33.2 / 46.8-47.2 / 138.4-139.2 for 16
# (one block an SM), and 8 splits 17.1-17.9 us at 4K against 16's 20.9-23.8 (a step's attention:
# 0.61-0.63 ms against 0.73-0.83; 8K: 12 splits 0.81-0.82 against 0.88-0.95). Why fewer blocks
# win is not known; chains of calls over exact multiples of a split's rows ranked 16 first.
# KVFN_TENSOR_CORES=0 turns it off, =1 runs it on every split and head_dim it takes
_TC_ENV = os.environ.get("KVFN_TENSOR_CORES", "")
if _TC_ENV not in ("", "0", "1"):
    raise ValueError(f"KVFN_TENSOR_CORES must be 0 or 1 (or unset), got {_TC_ENV!r}")
TENSOR_CORES = ENABLED and _TC_ENV != "0"
_EVERYWHERE = _TC_ENV == "1"
MMA_DTYPES = (mx.float16, mx.bfloat16)
MMA_DIMS = (64, 128)
MMA_RUN_DIMS = None if _EVERYWHERE else (128,)  # None: every head_dim it takes
MMA_MIN_KEYS_PER_SPLIT = 0 if _EVERYWHERE else 256
MMA_KEYS_PER_SPLIT = 512
MMA_FILL = 0.75
MMA_THREADS = 256
MMA_BLOCKS_PER_SM = 1
MMA_MAX_HEADS = 8  # query heads a block of the tensor-core kernel (its A operand's rows 0-7)

CUDA = Path(__file__).parent / "cuda"


def source(name: str) -> str:
    """A CUDA source (or header) of kvfn's kernels, from ``kvfn/kernels/cuda/``."""
    return (CUDA / name).read_text()


HEADER = source("decode.cuh")

# One block per (key split, batch x KV head x head tile). Template constants, each fixed by the
# model and the layout's kind (so a new prompt length or capacity compiles nothing): T (dtype), W
# (warps a block, THREADS / 32), D (head_dim), G (query heads per block), GT (query heads per
# KV head), NT = GT / G, HKV (KV heads), LSB / LSH (lengths' batch / head strides, 0 where
# broadcast), U (consecutive keys a lane group loads per step), ST (steps
# of rows in flight, copied to shared memory by cp.async; 0: registers), P (with ST = 0, load
# the next step's rows before this step's math). Read at run time: NS (splits, the grid's x)
# and the sizes in ``dims`` (C, the capacity). Each lane holds 16 bytes of a row; LPK lanes
# hold one row; a warp step covers KPW groups x U consecutive keys. Scores are in base 2 (q is
# scaled by scale * log2(e)).
SPLIT_SOURCE = source("split.cu")

# One block per query head (batch-flattened), one thread per dimension: the splits' partial
# outputs (dims[0] of them) weighted by 2^lse. No valid key at all gives zeros.
COMBINE_SOURCE = source("combine.cu")


# The split kernel on tensor cores (bf16 / fp16, head_dim 64 or 128): the same outputs and
# combine as SPLIT_SOURCE (in its own blocks, MMA_THREADS, and splits, plan(mma=True)), but a
# warp scores and accumulates 16 keys a step with mma.sync (m16n8k16, float32 accumulators).
# The block's G query heads are the rows of a 16-row A operand (rows G..15 zero); the
# probabilities stay in the registers the score mma wrote them to (FlashAttention-2's layout)
# and are rounded to T. Each warp stages its 16 K and V rows
# whole (cp.async) into swizzled shared memory and reads its fragments by ldmatrix. Scores are
# in base 2 (scale holds scale * log2(e)).
MMA_HEADER = HEADER + source("mma.cuh")
MMA_SPLIT_SOURCE = source("mma_split.cu")


# The sizes a split kernel reads at run time (its ``dims`` input, so that a new capacity or
# buffer compiles nothing): the plain kernel's capacity C; each layout's source below replaces
# these two lines with its own sizes and length.
SIZE_LINE = "  const int C = dims[0];\n"
LENGTH_LINE = "  const int len = min(max(lengths[(bh / HKV) * LSB + (bh % HKV) * LSH], 0), C);\n"


# The split kernel over two head parts of one layer (kvfn.partitioned): each KV head h reads
# part hmap[2h] (0 or 1) at index hmap[2h + 1] in it; part 0 (k0, v0: (B, H0, C0, D)) has the
# valid slots [0, lengths), part 1 (k1, v1: (B, H1, C1, D)) the first L1. Queries and outputs
# stay in the layer's query-head order, so no gather puts the parts' outputs back in order.
def _two_part_source() -> str:
    source = SPLIT_SOURCE
    edits = (
        (
            SIZE_LINE + LENGTH_LINE,
            "  const int C0 = dims[0];\n"
            "  const int C1 = dims[1];\n"
            "  const int L1 = dims[2];\n"
            "  const int grp = hmap[2 * (bh % HKV)];\n"
            "  const int gidx = hmap[2 * (bh % HKV) + 1];\n"
            "  const int C = grp == 0 ? C0 : C1;\n"
            "  const T* k = grp == 0 ? k0 : k1;\n"
            "  const T* v = grp == 0 ? v0 : v1;\n"
            "  const int len = min(max(grp == 0 ? lengths[(bh / HKV) * LSB] : L1, 0), C);\n",
        ),
        (
            "  const size_t base = (size_t)bh * C * D + part * EPT;\n",
            "  const size_t base =\n"
            "      ((size_t)(bh / HKV) * (grp == 0 ? H0 : H1) + gidx) * C * D + part * EPT;\n",
        ),
    )
    for old, replacement in edits:
        if source.count(old) != 1:
            raise RuntimeError("kvfn.kernels: the split kernel's source changed; update the edit")
        source = source.replace(old, replacement)
    return source


TWO_PART_SOURCE = _two_part_source()


# The split kernels over one buffer of slots a layer, k, v (B, S, D), each KV head its own
# range: the slots layout (kvfn.slots, Duo) and the ragged one (kvfn.ragged, Ada-KV).
BASE_LINES = ("  const size_t base = (size_t)bh * C * D + part * EPT;\n",
              "  const size_t base = (size_t)bh * C * D;\n")  # fmt: skip


def _from_first_slot(source: str, length: str) -> str:
    """A split kernel's source (CUDA or tensor cores) over one (B, S, D) buffer of slots whose
    KV head starts at slot ``first``: its length line replaced by ``length`` (which sets
    ``first`` and ``len``), its base pointing at slot ``first`` of its sequence."""
    if source.count(SIZE_LINE + LENGTH_LINE) != 1:
        raise RuntimeError("kvfn.kernels: the split kernel's source changed; update the edit")
    source = source.replace(SIZE_LINE + LENGTH_LINE, length)
    for old in BASE_LINES:
        if old in source:
            return source.replace(
                old, old.replace("(size_t)bh * C * D", "((size_t)(bh / HKV) * S + first) * D")
            )
    raise RuntimeError("kvfn.kernels: the split kernel's source changed; update the edit")


# Slots: KV head h owns the slots from hmap[2h], in part hmap[2h + 1]: 0, C0 slots of which
# [0, lengths) are valid, or 1, C1 slots of which the first L1.
SLOTS_LENGTH = (
    "  const int S = dims[0];\n"
    "  const int C0 = dims[1];\n"
    "  const int C1 = dims[2];\n"
    "  const int L1 = dims[3];\n"
    "  const int first = hmap[2 * (bh % HKV)];\n"
    "  const int grp = hmap[2 * (bh % HKV) + 1];\n"
    "  const int C = grp == 0 ? C0 : C1;\n"
    "  const int len = min(max(grp == 0 ? lengths[(bh / HKV) * LSB] : L1, 0), C);\n"
)
SLOTS_SOURCE = _from_first_slot(SPLIT_SOURCE, SLOTS_LENGTH)
MMA_SLOTS_SOURCE = _from_first_slot(MMA_SPLIT_SOURCE, SLOTS_LENGTH)


# Ragged: KV head h of sequence b holds the slots [starts, starts + lengths) (int32 (B, HKV),
# flat index b * HKV + h).
RANGES_LENGTH = (
    "  const int S = dims[0];\n"
    "  const int first = starts[bh];\n"
    "  const int len = min(max(lengths[bh], 0), max(S - first, 0));\n"
)
RANGES_SOURCE = _from_first_slot(SPLIT_SOURCE, RANGES_LENGTH)
MMA_RANGES_SOURCE = _from_first_slot(MMA_SPLIT_SOURCE, RANGES_LENGTH)


def ranges_decode_attention(q, k, v, starts, lengths, *, scale):
    """Decode attention of one query token over a layer in the ragged layout (``kvfn.ragged``),
    in one launch (plus the split combine): q (B, n_q_heads, 1, D); k, v (B, S, D); KV head h
    of sequence b reads the slots [starts[b, h], starts[b, h] + lengths[b, h]) (int32 (B,
    n_kv_heads)). Returns (B, n_q_heads, 1, D) in q's dtype and query-head order; no valid
    slot gives zeros. Only where ``ranges_fused`` says so (``kvfn.ragged.attend`` falls back to
    the masked SDPA elsewhere)."""
    batch, q_heads, _, dim = q.shape
    kv_heads = starts.shape[1] if starts.ndim == 2 else 0
    if (
        q.shape[2] != 1
        or k.ndim != 3
        or k.shape[0] != batch
        or k.shape[2] != dim
        or k.shape != v.shape
        or not kv_heads
        or q_heads % kv_heads
    ):
        raise ValueError(f"q {q.shape} does not fit ragged slots {k.shape} / {v.shape} of "
                         f"{starts.shape} heads")  # fmt: skip
    for name, x in (("starts", starts), ("lengths", lengths)):
        if x.dtype != mx.int32 or x.shape != (batch, kv_heads):
            raise ValueError(f"{name} must be int32 ({batch}, {kv_heads}), got {x.dtype} "
                             f"{x.shape}")  # fmt: skip
    capacity = max(1, k.shape[1] // kv_heads)  # a head's slots on average: sizes the splits
    mma = _mma_applies(q, k, kv_heads, capacity)
    kernel = _mma_ranges_kernel if mma else _ranges_kernel
    return _split_and_combine(kernel, [q, k, v, starts.reshape(-1), lengths.reshape(-1)], q,
                              kv_heads, capacity, k.dtype, scale, [("HKV", kv_heads)],
                              [k.shape[1]], mma)  # fmt: skip


def ranges_fused(q, k, v, kv_heads: int) -> bool:
    """Whether ``ranges_decode_attention`` runs for one query token over these (B, S, D) slots
    of ``kv_heads`` KV heads (the split kernel's conditions)."""
    if k.ndim != 3 or k.shape != v.shape or not kv_heads or k.shape[1] < kv_heads:
        return False
    return _kernel_applies(q, k, v, rows=k.shape[1])


@lru_cache(maxsize=None)
def _ranges_kernel(shared_memory: int):
    return cuda_kernel("kvfn_ranges_decode_split", ["q", "k", "v", "starts", "lengths", "scale", "dims"],
                       ["o_part", "lse"], RANGES_SOURCE, shared_memory=shared_memory)  # fmt: skip


@lru_cache(maxsize=None)
def _mma_ranges_kernel(shared_memory: int):
    return cuda_kernel("kvfn_ranges_decode_mma", ["q", "k", "v", "starts", "lengths", "scale", "dims"],
                       ["o_part", "lse"], MMA_RANGES_SOURCE, header=MMA_HEADER,
                       shared_memory=shared_memory)  # fmt: skip


def ragged_decode_attention(q, k, v, lengths, *, scale):
    """Attention of one query token to the first ``lengths`` slots of each (batch, KV head).

    q: (B, n_q_heads, 1, D); k, v: (B, n_kv_heads, C, D), n_q_heads a multiple of n_kv_heads
    (query head i reads KV head i // (n_q_heads // n_kv_heads)); lengths: int32 of shape (),
    (B,) or (B, n_kv_heads) (size-1 axes broadcast), slots ``[0, lengths)`` valid, clipped to
    [0, C]. Returns (B, n_q_heads, 1, D) in q's dtype; the softmax runs in float32. Equals
    ``mx.fast.scaled_dot_product_attention`` masked to ``slot < lengths``, except that a length
    of 0 gives zeros (not NaN). Slots at or past the length do not change the result as long as
    they are finite (the CUDA kernel never reads them; the fallback masks them). On CUDA, supported shapes run a split-K kernel; everything else
    (CPU, Metal, other head_dims or dtypes) uses the masked SDPA.
    """
    lengths = _checked(q, k, v, lengths)
    if _kernel_applies(q, k, v):
        return _kernel_attention(q, k, v, lengths, float(scale))
    return _masked_attention(q, k, v, lengths, scale)


def _checked(q, k, v, lengths):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, mx.array) or x.ndim != 4:
            raise ValueError(
                f"{name} must be an mx.array (B, heads, length, head_dim); got {x!r:.80}"
            )
        if not mx.issubdtype(x.dtype, mx.floating):
            raise ValueError(f"{name} must be floating; got {x.dtype}")
    if q.shape[2] != 1:
        raise ValueError(f"q must hold one query token; got q.shape={q.shape}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {k.shape} vs {v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {q.shape} and k {k.shape} differ in batch or head_dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"n_q_heads={q.shape[1]} is not a multiple of n_kv_heads={k.shape[1]}")
    return _checked_lengths(lengths, k.shape[0], k.shape[1])


def _checked_lengths(lengths, batch, kv_heads):
    if isinstance(lengths, int) and not isinstance(lengths, bool):
        lengths = mx.array(lengths, dtype=mx.int32)
    if not isinstance(lengths, mx.array):
        raise ValueError(f"lengths must be an int32 mx.array; got {type(lengths).__name__}")
    if lengths.dtype != mx.int32:
        raise ValueError(f"lengths must be int32; got {lengths.dtype}")
    allowed = ((), ((1, batch),), ((1, batch), (1, kv_heads)))
    if lengths.ndim > 2 or any(n not in ok for n, ok in zip(lengths.shape, allowed[lengths.ndim])):
        raise ValueError(
            f"lengths.shape={lengths.shape} is not (), ({batch},) or ({batch}, {kv_heads})"
        )
    return lengths


def _masked_attention(q, k, v, lengths, scale):
    """kvfn's masked SDPA over slot < lengths, with zeros where no slot is valid."""
    limit = _per_query_head(lengths, q.shape[1] // k.shape[1])
    mask = mx.arange(k.shape[2], dtype=mx.int32) < limit
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    return mx.where(limit > 0, out, mx.array(0, dtype=out.dtype))


def _per_query_head(lengths, group):
    """lengths as (B or 1, n_q_heads or 1, 1, 1)."""
    limit = lengths.reshape(lengths.shape + (1,) * (4 - lengths.ndim))
    if lengths.ndim == 1:
        return limit
    if lengths.ndim == 2 and lengths.shape[1] > 1 and group > 1:
        return mx.repeat(limit, group, axis=1)
    return limit


def _kernel_applies(q, k, v, rows=None) -> bool:
    """The split kernel's conditions: CUDA, one supported dtype, a head_dim it tiles, and rows
    (``k.shape[2]`` unless given) to read."""
    if not ENABLED or not on_cuda():
        return False
    if not (q.dtype == k.dtype == v.dtype) or k.dtype not in KERNEL_DTYPES:
        return False
    rows = k.shape[2] if rows is None else rows
    lanes = q.shape[3] * k.dtype.size // 16  # lanes holding one row, 16 bytes each
    return rows > 0 and lanes * 16 == q.shape[3] * k.dtype.size and lanes in (2, 4, 8, 16, 32)


def plan(batch, q_heads, kv_heads, capacity, mma=False):
    """(query heads per block, head tiles per KV head, key splits) for the split kernel: one wave
    of ``BLOCKS_PER_SM`` blocks an SM, splits of at least ``MIN_KEYS_PER_SPLIT`` rows; ``mma``:
    for its tensor-core version, ``MMA_FILL`` of a wave of ``MMA_BLOCKS_PER_SM`` blocks an SM,
    splits of at least ``MMA_KEYS_PER_SPLIT`` rows (and ``MMA_MIN_KEYS_PER_SPLIT``, the least
    it runs on)."""
    group = q_heads // kv_heads
    tile = max(g for g in range(1, MAX_HEADS_PER_BLOCK + 1) if group % g == 0)
    rows = batch * kv_heads * (group // tile)
    if mma:
        blocks = int(MMA_FILL * MMA_BLOCKS_PER_SM * SMS)
        least = max(MMA_KEYS_PER_SPLIT, MMA_MIN_KEYS_PER_SPLIT)
    else:
        blocks, least = BLOCKS_PER_SM * SMS, MIN_KEYS_PER_SPLIT
    wanted = blocks // rows  # rounded down: no straggling partial wave
    splits = max(1, min(wanted, capacity // least, MAX_SPLITS))
    return tile, group // tile, splits


def staged_bytes(unroll: int) -> int:
    """Shared memory a block of the split kernel stages its rows in: ``STAGES`` steps of K and
    V, ``unroll`` rows of 16 bytes a thread each."""
    return STAGES * 2 * unroll * THREADS * 16


def split_shared_bytes(tile: int, dim: int, unroll: int) -> tuple:
    """(static, dynamic) shared memory a block of the CUDA-core split kernels takes: its warps'
    online-softmax states (W x G x (D + 2) floats) and its staged rows. A block may hold more
    than 48 KB in all only where MLX opts the kernel in, which it does for over 48000 dynamic
    bytes, so past 48 KB the dynamic part is raised to 48 KB (head_dim 256 needs it)."""
    static = THREADS // 32 * tile * (dim + 2) * 4
    dynamic = staged_bytes(unroll)
    if static > SHARED_LIMIT:
        raise ValueError(
            f"the split kernel's {THREADS // 32} warps x {tile} query heads x head_dim {dim} "
            f"need {static} bytes of static shared memory, more than {SHARED_LIMIT}: fewer "
            f"THREADS or MAX_HEADS_PER_BLOCK"
        )
    if static + dynamic > SHARED_LIMIT:
        dynamic = max(dynamic, SHARED_LIMIT)
    return static, dynamic


def mma_staged_bytes(dim: int) -> int:
    """Shared memory a block of the tensor-core split kernel stages its rows in: ``STAGES``
    (at least one) steps of each of its ``MMA_THREADS / 32`` warps' 16 K and 16 V rows of ``dim``
    2-byte elements."""
    return max(STAGES, 1) * (MMA_THREADS // 32) * 32 * dim * 2


def _split_and_combine(split_kernel, inputs, q, kv_heads, capacity, dtype, scale, template,
                       dims, mma=False):  # fmt: skip
    """One split-K launch of ``split_kernel(shared bytes)`` (its ``inputs``, the scale, then its
    sizes ``dims`` as an int32 array; its own ``template`` entries after the shared ones; ``mma``:
    the tensor-core kernel's staging) over
    ``capacity`` rows a KV head, then the combine: (B, n_q_heads, 1, D) in q's dtype. With one
    split the split kernel writes that output itself (the combine would copy it)."""
    name, threads = ("MMA_THREADS", MMA_THREADS) if mma else ("THREADS", THREADS)
    if threads % 32 or not 32 <= threads <= 256:
        raise ValueError(f"kvfn.kernels.{name} must be 32, 64, ... or 256; got {threads}")
    batch, q_heads, _, dim = q.shape
    tile, tiles, splits = plan(batch, q_heads, kv_heads, capacity, mma)
    if mma:
        shared = mma_staged_bytes(dim)
        staging = [("ST", max(STAGES, 1))]
    else:
        unroll = UNROLL or (4 if tile <= 4 else 2)
        shared = split_shared_bytes(tile, dim, unroll)[1]
        staging = [("U", unroll), ("ST", STAGES), ("P", PREFETCH)]
    o_part, lse = split_kernel(shared)(
        inputs=[*inputs, mx.array([scale * LOG2E], dtype=mx.float32), _ints(dims)],
        template=[
            ("T", dtype),
            ("W", threads // 32),
            ("D", dim),
            ("G", tile),
            ("GT", q_heads // kv_heads),
            ("NT", tiles),
            *template,
            *staging,
        ],
        grid=(splits * threads, batch * kv_heads * tiles, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(batch * q_heads * splits * dim,), (batch * q_heads * splits,)],
        output_dtypes=[q.dtype if splits == 1 else mx.float32, mx.float32],
    )
    if splits == 1:
        return o_part.reshape(q.shape)
    (out,) = _combine_kernel()(
        inputs=[o_part, lse, _ints([splits])],
        template=[("T", q.dtype), ("D", dim)],
        grid=(batch * q_heads * dim, 1, 1),
        threadgroup=(dim, 1, 1),
        output_shapes=[q.shape],
        output_dtypes=[q.dtype],
    )
    return out


def _kernel_attention(q, k, v, lengths, scale):
    kv_heads, capacity = k.shape[1], k.shape[2]
    lb, lh = lengths.shape + (1,) * (2 - lengths.ndim)
    template = [("HKV", kv_heads), ("LSB", lh if lb > 1 else 0), ("LSH", 1 if lh > 1 else 0)]
    mma = _mma_applies(q, k)
    return _split_and_combine(_mma_split_kernel if mma else _split_kernel,
                              [q, k, v, lengths.reshape(-1)], q, kv_heads, capacity, k.dtype,
                              scale, template, [capacity], mma)  # fmt: skip


def _mma_applies(q, k, kv_heads=None, capacity=None) -> bool:
    """The tensor-core split kernel's conditions, beyond the split kernel's (``TENSOR_CORES``):
    a dtype it takes, a head_dim it takes and runs on (``MMA_RUN_DIMS``), at most 8 query heads
    a block (its A operand's rows), and plan's splits for it of at least
    ``MMA_MIN_KEYS_PER_SPLIT`` rows of the capacity (static, as shapes are). ``kv_heads`` and
    ``capacity`` default to k's (B, H, C, D) shape."""
    dim = q.shape[3]
    runs = dim in MMA_DIMS and (MMA_RUN_DIMS is None or dim in MMA_RUN_DIMS)
    if not (TENSOR_CORES and k.dtype in MMA_DTYPES and runs):
        return False
    kv_heads = k.shape[1] if kv_heads is None else kv_heads
    capacity = k.shape[2] if capacity is None else capacity
    tile, _, splits = plan(q.shape[0], q.shape[1], kv_heads, capacity, mma=True)
    return tile <= MMA_MAX_HEADS and capacity // splits >= MMA_MIN_KEYS_PER_SPLIT


def two_part_decode_attention(q, k0, v0, lengths, k1, v1, length1: int, head_map, *, scale):
    """Decode attention of one query token over a layer whose KV heads are split into two
    parts that store different rows, in one fused launch (plus the split combine), on CUDA.

    q: (B, n_q_heads, 1, D) in the layer's query-head order (query head i reads KV head
    i // (n_q_heads // n_kv_heads)); part 0: k0, v0 (B, H0, C0, D), slots ``[0, lengths)``
    valid (int32 () or (B,)); part 1: k1, v1 (B, H1, C1, D), slots ``[0, length1)`` valid
    (a static int); head_map: int32 (2 * n_kv_heads,), for KV head h its part
    ``head_map[2h]`` and its index in that part ``head_map[2h + 1]``. Returns
    (B, n_q_heads, 1, D) in q's dtype and query-head order: what ``ragged_decode_attention``
    gives per part, put back in head order. Only where ``two_part_fused`` says so."""
    batch, q_heads, _, dim = q.shape
    kv_heads = head_map.shape[0] // 2
    if q.shape[2] != 1 or q_heads % kv_heads or k0.shape[3] != dim or k1.shape[3] != dim:
        raise ValueError(f"q {q.shape} does not fit parts {k0.shape}, {k1.shape}")
    if k0.shape[1] + k1.shape[1] != kv_heads or k0.shape[0] != batch or k1.shape[0] != batch:
        raise ValueError(f"parts {k0.shape}, {k1.shape} do not hold {kv_heads} KV heads")
    if lengths.dtype != mx.int32 or lengths.ndim > 1 or lengths.size not in (1, batch):
        raise ValueError(f"lengths must be int32 () or ({batch},), got {lengths.shape}")
    template = [("H0", k0.shape[1]), ("H1", k1.shape[1]), ("HKV", kv_heads),
                ("LSB", 1 if lengths.size > 1 else 0)]  # fmt: skip
    inputs = [q, k0, v0, k1, v1, lengths.reshape(-1), head_map]
    return _split_and_combine(_two_part_kernel, inputs, q, kv_heads,
                              max(k0.shape[2], k1.shape[2]), k0.dtype, scale, template,
                              [k0.shape[2], k1.shape[2], int(length1)])  # fmt: skip


def slots_decode_attention(q, k, v, lengths, capacity: int, ring: int, head_map, *, scale):
    """``two_part_decode_attention`` over the slots layout (``kvfn.slots``): k, v (B, S, D),
    KV head h owns the slots from ``head_map[2h]``, in part ``head_map[2h + 1]``: 0, of
    ``capacity`` slots, ``[0, lengths)`` valid (int32 () or (B,)), or 1, a full ring of
    ``ring`` slots. One fused launch plus the combine; queries and outputs in head order. Only
    where ``slots_fused`` says so."""
    batch, q_heads, _, dim = q.shape
    kv_heads = head_map.shape[0] // 2
    if q.shape[2] != 1 or q_heads % kv_heads or k.ndim != 3 or k.shape[2] != dim:
        raise ValueError(f"q {q.shape} does not fit slots {k.shape}")
    if k.shape != v.shape or k.shape[0] != batch:
        raise ValueError(f"slots keys {k.shape} and values {v.shape} do not fit q {q.shape}")
    if lengths.dtype != mx.int32 or lengths.ndim > 1 or lengths.size not in (1, batch):
        raise ValueError(f"lengths must be int32 () or ({batch},), got {lengths.shape}")
    if not _holds_heads(k.shape[1], kv_heads, int(capacity), int(ring)):
        raise ValueError(f"{k.shape[1]} slots are not {kv_heads} KV heads of {capacity} (plain) "
                         f"or {ring} (ring) slots")  # fmt: skip
    template = [("HKV", kv_heads), ("LSB", 1 if lengths.size > 1 else 0)]
    rows = max(capacity, ring)
    mma = _mma_applies(q, k, kv_heads, rows)
    return _split_and_combine(_mma_slots_kernel if mma else _slots_kernel,
                              [q, k, v, lengths.reshape(-1), head_map], q, kv_heads, rows,
                              k.dtype, scale, template,
                              [k.shape[1], int(capacity), int(ring), int(ring)], mma)  # fmt: skip


def _holds_heads(slots: int, kv_heads: int, capacity: int, ring: int) -> bool:
    """Whether ``slots = plain * capacity + (kv_heads - plain) * ring`` for some plain count."""
    return any(p * capacity + (kv_heads - p) * ring == slots for p in range(kv_heads + 1))


def slots_fused(q, k, v) -> bool:
    """Whether ``slots_decode_attention`` runs for these (B, S, D) slots (the fused kernel's
    conditions; ``KVFN_TWO_PART_KERNEL=0`` turns it off)."""
    if not TWO_PART_ENABLED or k.shape != v.shape or k.ndim != 3:
        return False
    return _kernel_applies(q, k, v, rows=k.shape[1])


@lru_cache(maxsize=None)
def _mma_slots_kernel(shared_memory: int):
    return cuda_kernel("kvfn_slots_decode_mma", ["q", "k", "v", "lengths", "hmap", "scale", "dims"],
                       ["o_part", "lse"], MMA_SLOTS_SOURCE, header=MMA_HEADER,
                       shared_memory=shared_memory)  # fmt: skip


@lru_cache(maxsize=None)
def _slots_kernel(shared_memory: int):
    return cuda_kernel("kvfn_slots_decode_split", ["q", "k", "v", "lengths", "hmap", "scale", "dims"],
                       ["o_part", "lse"], SLOTS_SOURCE, shared_memory=shared_memory)  # fmt: skip


def two_part_fused(q, k0, k1) -> bool:
    """Whether ``two_part_decode_attention`` runs for these arrays: the fused kernel applies
    to both parts, in one dtype (``KVFN_TWO_PART_KERNEL=0`` turns it off)."""
    if not TWO_PART_ENABLED or k0.dtype != k1.dtype:
        return False
    return _kernel_applies(q, k0, k0) and _kernel_applies(q, k1, k1)


@lru_cache(maxsize=None)
def _two_part_kernel(shared_memory: int):
    return cuda_kernel("kvfn_two_part_decode_split",
                       ["q", "k0", "v0", "k1", "v1", "lengths", "hmap", "scale", "dims"],
                       ["o_part", "lse"], TWO_PART_SOURCE, shared_memory=shared_memory)  # fmt: skip


@lru_cache(maxsize=None)
def _split_kernel(shared_memory: int):
    return cuda_kernel("kvfn_ragged_decode_split", ["q", "k", "v", "lengths", "scale", "dims"],
                       ["o_part", "lse"], SPLIT_SOURCE, shared_memory=shared_memory)  # fmt: skip


@lru_cache(maxsize=None)
def _mma_split_kernel(shared_memory: int):
    return cuda_kernel("kvfn_ragged_decode_mma", ["q", "k", "v", "lengths", "scale", "dims"],
                       ["o_part", "lse"], MMA_SPLIT_SOURCE, header=MMA_HEADER,
                       shared_memory=shared_memory)  # fmt: skip


@lru_cache(maxsize=None)
def _combine_kernel():
    return cuda_kernel("kvfn_ragged_decode_combine", ["o_part", "lse", "dims"], ["out"],
                       COMBINE_SOURCE)


def _ints(values) -> mx.array:
    """Sizes a kernel reads at run time (its ``dims`` input)."""
    return mx.array([int(v) for v in values], dtype=mx.int32)


def cuda_kernel(name, input_names, output_names, source, header=HEADER, shared_memory=0):
    """``mx.fast.cuda_kernel`` named ``name`` and a digest of its header and source: MLX caches
    compiled CUDA modules on disk by name (and template arguments) across processes, so an
    edited source under an old name would run the old code."""
    digest = hashlib.sha256((header + source).encode()).hexdigest()[:12]
    return mx.fast.cuda_kernel(name=f"{name}_{digest}", input_names=input_names,
                               output_names=output_names, source=source, header=header,
                               shared_memory=shared_memory)  # fmt: skip


def on_cuda() -> bool:
    """Whether arrays run on MLX's CUDA backend (the default device a CUDA GPU)."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def sdpa_mask(mask, queries: mx.array):
    """``mask`` as ``mx.fast.scaled_dot_product_attention`` runs it best for ``queries``: on
    CUDA a boolean array over several queries becomes additive (0 where seen, -inf where not,
    in the queries' dtype); anything else as it is. MLX's CUDA backend has no fused kernel for a
    boolean mask there: its fallback materializes the scores and builds kernels for every new
    shape (about 40 ms a layer at a query count it has not seen, H100, MLX 0.32.4), while an
    additive mask keeps cuDNN's fused kernel. The attention is the same (exp(-inf) = 0); a
    query that sees no row gets NaN either way."""
    if (
        isinstance(mask, mx.array)
        and mask.dtype == mx.bool_
        and queries.shape[2] > 1
        and additive_masks()
    ):
        return mx.where(mask, mx.array(0, queries.dtype), mx.array(-mx.inf, queries.dtype))
    return mask


def attention(queries, keys, values, *, scale, mask=None, sinks=None) -> mx.array:
    """``mx.fast.scaled_dot_product_attention`` with ``mask`` as ``sdpa_mask`` gives it: kvfn's
    every masked attention over several queries."""
    mask = sdpa_mask(mask, queries)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask,
                                                sinks=sinks)  # fmt: skip


def additive_masks() -> bool:
    """Whether ``sdpa_mask`` makes a boolean mask additive: on CUDA."""
    return on_cuda()


def fused(q, k, v) -> bool:
    """Whether ``ragged_decode_attention`` runs the fused kernel for these arrays (MLX's CUDA
    backend, a supported dtype and head_dim); elsewhere it is the masked SDPA."""
    return _kernel_applies(q, k, v)
