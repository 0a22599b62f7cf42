"""compact_prompt_cache: scored chunked prefill, SnapKV selection and eviction."""

from typing import Callable, Optional, Sequence

import mlx.core as mx
from typeguard import typechecked

from kvfn import cache as kv
from kvfn.evict import EvictionResult, evict_prompt_cache
from kvfn.snapkv import SnapKVConfig, keep_indices

from .wrapper import FunctionalModel, ScoreWindow


def chunks(n: int, size: int) -> list[tuple[int, int]]:
    return [(i, min(i + size, n)) for i in range(0, n, size)]


@typechecked
def prefill(
    fmodel: FunctionalModel,
    tokens: mx.array,
    *,
    capacity: int,
    prefill_step_size: int = 512,
    score_window: int = 0,
    dtype: mx.Dtype = mx.float32,
    progress: Optional[Callable[[int, int], None]] = None,
    states: Optional[tuple] = None,
    compiled: bool = True,
) -> tuple:
    """Prefill ``tokens`` (B, n) in compiled chunks into fresh states of ``capacity`` rows, or
    after what ``states`` already hold (then their capacity is used). ``compiled=False`` runs
    the eager forward pass instead: worth it when shapes change from call to call (each new
    shape is a new trace, and on CUDA a new kernel compilation).

    With ``score_window`` w > 0, the attention of the last w tokens' queries over every key is
    summed into per-key scores, chunk by chunk (the window may span chunks): returns
    ``(states, scores)``, scores one (B, n_heads, capacity) array per layer; else ``states``.
    """
    if prefill_step_size <= 0:
        raise ValueError(f"prefill_step_size must be positive, got {prefill_step_size}")
    B, n = tokens.shape
    if states is None:
        states = fmodel.init_states(B, capacity, dtype)
    capacity, free = states[0].capacity, states[0].capacity - int(states[0].rows.item())
    if free < n:
        raise ValueError(f"capacity {capacity} cannot hold {n} more prompt tokens ({free} free)")
    scores = (
        [mx.zeros((B, h, capacity), mx.float32) for h in fmodel.n_heads] if score_window else []
    )
    for start, stop in chunks(n, prefill_step_size):
        w0 = max(n - score_window, start) if score_window else stop
        step = fmodel.prefill if compiled else fmodel.forward
        if w0 < stop:
            _, states, scores = step(
                tokens[:, start:stop], states, scores, ScoreWindow(w0 - start, stop - start)
            )
        else:
            _, states = step(tokens[:, start:stop], states)
        mx.eval(kv.arrays(states), scores)
        if progress is not None:
            progress(stop, n)
    return (states, tuple(scores)) if score_window else states


@typechecked
def compact_prompt_cache(
    fmodel: FunctionalModel,
    prompt_tokens: Sequence[int] | mx.array,
    *,
    budget: int,
    window: int = 32,
    sink_tokens: int = 4,
    min_tokens: int = 0,
    kernel_size: int = 7,
    pooling: str = "max",
    per_head: bool = True,
    group_reduce: str = "mean",
    max_new_tokens: int = 256,
    prefill_step_size: int = 512,
    dtype: mx.Dtype = mx.float32,
    progress: Optional[Callable[[int, int], None]] = None,
) -> tuple[tuple, EvictionResult]:
    """Prefill all but the last prompt token with scoring, keep a SnapKV budget of rows in every
    full-attention layer, and reserve room for ``max_new_tokens``. The caller decodes from the
    last prompt token. Accepts one prompt (a list of ints) or a batch of equal-length prompts."""
    cfg = SnapKVConfig(budget, window, sink_tokens, min_tokens, kernel_size, pooling, per_head,
                       group_reduce)  # fmt: skip
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    tokens = (
        prompt_tokens if isinstance(prompt_tokens, mx.array) else mx.array([list(prompt_tokens)])
    )
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"need a (batch, length >= 2) prompt, got shape {tuple(tokens.shape)}")
    context = tokens[:, :-1]
    P = context.shape[1]
    scored = not cfg.keeps_whole(P)
    out = prefill(fmodel, context, capacity=P, prefill_step_size=prefill_step_size,
                  score_window=min(window, P) if scored else 0, dtype=dtype,
                  progress=progress)  # fmt: skip
    states, scores = out if scored else (out, None)
    keep = [
        None if w is not None or not scored else keep_indices(scores[i], cfg, fmodel.n_kv_heads[i])
        for i, w in enumerate(fmodel.windows)
    ]
    states, result = evict_prompt_cache(states, keep)
    states = tuple(kv.reserve(s, s.capacity + max_new_tokens + 1) for s in states)
    mx.eval(kv.arrays(states))
    return states, result
