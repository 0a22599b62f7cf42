"""Thread kvfn's immutable layer states through an unmodified mlx-lm model.

``FunctionalModel(model).forward(tokens, states)`` returns ``(logits, new_states)``: each
layer's state goes in, a new one comes out, nothing is mutated. Inside one call, every layer
gets a short-lived adapter that speaks mlx-lm's cache protocol (``offset``,
``update_and_fetch``, ``make_mask``) over its state. Two per-instance hooks are installed for
the duration of the call only (never on import, never process-wide):

* each attention module is called with its own layer's mask (per layer and per KV head, from
  true positions), instead of the one mask an mlx-lm model builds from a single layer;
* while scoring, the attention's ``rope`` is tapped to read the queries after RoPE, so the
  observation window's attention over the keys is reduced to per-key scores in the same pass.

``prefill`` and ``decode`` are the ``mx.compile``'d versions; states cross the compiled
boundary as flat dicts of arrays (``kvfn.cache.flatten``).
"""

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache

from kvfn import cache as kv
from kvfn.snapkv import window_attention_scores

ATTENTION_NAMES = ("self_attn", "attention", "attn")


@dataclass(frozen=True)
class ScoreWindow:
    """Which query rows of this call (a static slice) belong to the observation window."""

    start: int
    stop: int


class _LayerAdapter:
    """mlx-lm's cache protocol over one layer's state, for the length of one forward call."""

    def __init__(self, state: kv.State, n_heads: int, scores=None, window=None, scale=None):
        self.state, self.n_heads = state, n_heads
        self.scores, self.window, self.scale = scores, window, scale
        self.queries = None

    @property
    def offset(self):
        return self.state.offset

    def make_mask(self, n, return_array=False, window_size=None):
        return None  # the attention hook passes this layer's own mask

    def attention_mask(self, n: int) -> mx.array:
        after = self.state.replace(
            positions=kv.appended_positions(self.state, n), offset=self.state.offset + n
        )
        m = kv.mask(after, n)
        rep = self.n_heads // m.shape[1]
        return mx.repeat(m, rep, axis=1) if rep > 1 else m

    def update_and_fetch(self, keys, values):
        before = self.state.offset
        self.state = kv.update(self.state, keys, values)
        if self.window is not None:
            if self.queries is None:
                raise RuntimeError("kvfn could not read this layer's queries (no rope call seen)")
            w = self.window
            q = self.queries[:, :, w.start : w.stop]
            qpos = before[:, None] + mx.arange(w.start, w.stop, dtype=mx.int32)[None]
            self.scores = self.scores + window_attention_scores(q, qpos, self.state, self.scale)
        return self.state.keys, self.state.values


class _MaskedAttention(nn.Module):
    def __init__(self, inner: nn.Module, adapter: _LayerAdapter):
        super().__init__()
        self.inner, self.adapter = inner, adapter

    def __call__(self, x, mask=None, cache=None, *args, **kwargs):
        return self.inner(x, self.adapter.attention_mask(x.shape[1]), cache, *args, **kwargs)


class _QueryTap(nn.Module):
    """Wraps an attention's rope: the first call of a forward pass rotates the queries."""

    def __init__(self, rope, adapter: _LayerAdapter):
        super().__init__()
        self.rope, self.adapter = rope, adapter

    def __call__(self, x, *args, **kwargs):
        out = self.rope(x, *args, **kwargs)
        if self.adapter.queries is None:
            self.adapter.queries = out
        return out


def _attention_name(layer: nn.Module, index: int) -> str:
    for name in ATTENTION_NAMES:
        if isinstance(getattr(layer, name, None), nn.Module):
            return name
    raise TypeError(
        f"kvfn found no attention module ({', '.join(ATTENTION_NAMES)}) in layer {index}"
    )


def layer_windows(model: nn.Module) -> tuple[Optional[int], ...]:
    """Per layer: None for full attention, the window for a sliding-window layer."""
    caches = (
        model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]
    )
    windows = []
    for i, c in enumerate(caches):
        if type(c) is KVCache:
            windows.append(None)
        elif type(c) is RotatingKVCache and c.keep == 0:
            windows.append(c.max_size)
        else:
            raise TypeError(f"layer {i} uses {type(c).__name__}, which kvfn does not thread yet")
    return tuple(windows)


class FunctionalModel:
    """An mlx-lm model as pure functions of (tokens, layer states)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.layers = list(model.layers)
        self.windows = layer_windows(model)
        self._attn_names = [_attention_name(l, i) for i, l in enumerate(self.layers)]
        attn = [getattr(l, n) for l, n in zip(self.layers, self._attn_names)]
        self.n_heads = [a.n_heads for a in attn]
        self.n_kv_heads = [a.n_kv_heads for a in attn]
        self.scales = [float(a.scale) if hasattr(a, "scale") else None for a in attn]
        self.head_dims = [a.head_dim if hasattr(a, "head_dim") else None for a in attn]
        self._lock = threading.Lock()
        self._compiled: dict = {}
        self.traces = 0  # how many times a compiled step was traced

    # -- states -----------------------------------------------------------------------------
    def init_states(self, batch: int, capacity: int, dtype=mx.float32) -> tuple:
        """Empty states, one per layer, each with room for ``capacity`` rows."""
        states = []
        for i, layer in enumerate(self.layers):
            attn = getattr(layer, self._attn_names[i])
            head_dim = self.head_dims[i] or attn.k_proj.weight.shape[0] // self.n_kv_heads[i]
            states.append(
                kv.init(batch, self.n_kv_heads[i], head_dim, capacity, dtype=dtype,
                        window=self.windows[i])  # fmt: skip
            )
        return tuple(states)

    # -- the pure forward pass ----------------------------------------------------------------
    @contextmanager
    def _hooks(self, adapters, tap_queries: bool):
        saved = []
        with self._lock:
            try:
                for layer, name, ad in zip(self.layers, self._attn_names, adapters):
                    inner = getattr(layer, name)
                    saved.append((layer, name, inner, inner.get("rope") if tap_queries else None))
                    if tap_queries:
                        if "rope" not in inner:
                            raise TypeError("kvfn scoring needs an attention module with a rope")
                        inner.rope = _QueryTap(inner.rope, ad)
                    setattr(layer, name, _MaskedAttention(inner, ad))
                yield
            finally:
                for layer, name, inner, rope in saved:
                    setattr(layer, name, inner)
                    if rope is not None:
                        inner.rope = rope

    def forward(self, tokens: mx.array, states: tuple, scores=None, window=None):
        """Logits (B, n, vocab) and new states; with ``scores``/``window``, also the scores of
        the window's queries added to ``scores`` (one (B, n_heads, capacity) array a layer)."""
        if len(states) != len(self.layers):
            raise ValueError(f"{len(states)} states for a model of {len(self.layers)} layers")
        scoring = window is not None
        if scoring and None in self.scales:
            raise TypeError("kvfn scoring needs each attention module's softmax `scale`")
        adapters = []
        for i, state in enumerate(states):
            # sliding-window layers are never evicted, so they are not scored
            scored = scoring and self.windows[i] is None
            adapters.append(_LayerAdapter(state, self.n_heads[i], scores[i] if scoring else None,
                                          window if scored else None, self.scales[i]))  # fmt: skip
        with self._hooks(adapters, tap_queries=scoring):
            logits = self.model(tokens, cache=adapters)
        new_states = tuple(a.state for a in adapters)
        if scoring:
            return logits, new_states, tuple(a.scores for a in adapters)
        return logits, new_states

    # -- compiled steps -------------------------------------------------------------------------
    def _compiled_step(self, key, build: Callable):
        fn = self._compiled.get(key)
        if fn is None:
            fn = self._compiled[key] = mx.compile(build())
        return fn

    def decode(self, tokens: mx.array, states: tuple) -> tuple:
        """Compiled: logits of the last position (B, vocab) and new states. Traced once per
        state shape and static layout, so a decode loop over fixed capacities traces once."""
        return self.prefill(tokens, states)

    def prefill(self, tokens: mx.array, states: tuple, scores=None, window=None) -> tuple:
        """Compiled step over a chunk: (logits of the last position, new states[, new scores])."""
        flat, static = zip(*(kv.flatten(s) for s in states))
        scoring = window is not None

        def build():
            def step(tokens, flat, scores):
                self.traces += 1
                states_in = tuple(map(kv.unflatten, flat, static))
                out = self.forward(tokens, states_in, scores if scoring else None, window)
                result = [out[0][:, -1], [kv.flatten(s)[0] for s in out[1]]]
                return result + ([list(out[2])] if scoring else [])

            return step

        tokens = tokens.astype(mx.int32)  # argmax gives uint32: one dtype, one trace
        step = self._compiled_step((static, window), build)
        out = step(tokens, list(flat), list(scores) if scoring else [])
        new_states = tuple(map(kv.unflatten, out[1], static))
        return (out[0], new_states, tuple(out[2])) if scoring else (out[0], new_states)
