"""Thread kvfn's immutable layer states through an unmodified mlx-lm model.

``FunctionalModel(model).forward(tokens, states)`` returns ``(logits, new_states)``: each
layer's state goes in, a new one comes out, nothing is mutated. During a call every layer gets
a short-lived adapter that speaks mlx-lm's cache protocol (``offset``, ``update_and_fetch``,
``make_mask``) over its state (``kvfn.adapters``).

The wrapper runs its own copy of the model's module tree down to the attention modules; every
other module, and so every weight, is shared with the caller's model. Its attention modules are
wrapped once, at construction: each is called with its own layer's mask instead of the one
mask an mlx-lm model builds from a single layer (none or "causal" for a dense state, as mlx-lm;
a slot mask for a packed one, computed once for the layers in lockstep; otherwise per KV head
from true positions), and its ``rope`` is tapped so a scored call reads the queries after
RoPE. The caller's model is never modified.

``step`` / ``scored_step`` / ``decode`` are the ``mx.compile``'d versions. They take the
model's parameters as inputs, so a weight changed after a trace is seen by the next call.
"""

import contextvars
import copy
import types
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from .adapters import Call, adapter_of
from .distributed import head_group
from .states import cache as kv
from .states import layout, ragged, slots, tree  # noqa: F401  (ragged, slots: their layouts)
from .states.layout import GROWTH, bucket, grown  # noqa: F401  (kvfn.wrapper's own names)

ATTENTION_NAMES = ("self_attn", "attention", "attn")
N_HEADS_NAMES = ("n_heads", "num_heads", "num_attention_heads")
N_KV_HEADS_NAMES = ("n_kv_heads", "num_key_value_heads", "num_kv_heads")
_current = contextvars.ContextVar("kvfn_layer_adapter", default=None)


# a decode pads per-head states (a ragged layer's slots, which its allocation sets) to the sizes
# of a trace the model has made, where they hold at most this much more memory
TRACE_SLACK = 0.25
KNOWN_SIZES = 64  # the decode traces' sizes remembered for it, per batch and kinds of layers
STATISTICS = ("attention", "max_attention", "moments", "reconstruction", "queries")


@dataclass(frozen=True)
class QuerySlice:
    """The query rows of one call (a static slice) that a scored call reads, and what it adds
    to each layer's scores: ``"attention"``, their attention over every key, summed (the
    observation window); ``"max_attention"``, the most any of them pays each key, kept as a
    running maximum; ``"moments"``, the sums of their queries before RoPE and of their outer
    products (``kvfn.scores.add_query_moments``); or ``"reconstruction"``, KVzip's scores of one
    reconstruction input (the call, after ``context`` prefilled rows; ``rows`` = (sink, start,
    end, context)): for each context row of [start, end), the most weight a query of the slice
    gives it in a softmax over rows [0, min(sink, start)), [start, end) and the call's own
    (``kvfn.scores.reconstruction_attention``), (B, n_heads, end - start) in place of the
    layer's scores; or ``"queries"``, the slice's queries after RoPE themselves, (B, n_heads,
    stop - start, head_dim) in place of the layer's scores (a pass that scores after several
    calls: KVzip's reconstruction input in steps)."""

    start: int
    stop: int
    statistic: str = "attention"
    rows: tuple = ()

    def __post_init__(self):
        if self.statistic not in STATISTICS:
            raise ValueError(f"statistic must be one of {STATISTICS}, got {self.statistic!r}")
        if self.statistic != "reconstruction":
            if self.rows:
                raise ValueError(f"only reconstruction takes rows, got {self.rows!r}")
            return
        ok = len(self.rows) == 4 and all(type(r) is int for r in self.rows)
        if not ok or self.rows[0] < 0 or not 0 <= self.rows[1] < self.rows[2] <= self.rows[3]:
            raise ValueError(
                "reconstruction rows must be ints (sink >= 0, start, end, context) with 0 <= "
                f"start < end <= context, got {self.rows!r}"
            )
        if self.start != 0:
            raise ValueError(f"reconstruction reads the call's queries from its first, got {self}")


def _attend(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's ``scaled_dot_product_attention`` as the copied attention modules see it: a cache
    with an ``attend`` computes it (the wrapper's adapters, the server's per-head caches); any
    other cache gets mlx-lm's own function."""
    attend = getattr(cache, "attend", None)
    if attend is None:
        return scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks)
    return attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)


def _calling_attend(attn: nn.Module) -> bool:
    """Make the (copied) attention module ``attn`` call ``_attend`` where its code calls mlx-lm's
    ``scaled_dot_product_attention``: its class's ``__call__`` is rebuilt over a copy of its
    module's globals, in a subclass of its own; the model's module and class are untouched.
    False when the code does not call that function (it computes attention itself)."""
    cls = type(attn)
    fn = getattr(cls.__call__, "__func__", cls.__call__)
    if "scaled_dot_product_attention" not in getattr(fn, "__code__", types.CodeType).co_names:
        return False
    scope = {**fn.__globals__, "scaled_dot_product_attention": _attend}
    call = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    call.__kwdefaults__ = fn.__kwdefaults__
    attn.__class__ = type(cls.__name__, (cls,), {"__call__": call})
    return True


def attending_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` (weights, module and class shared) whose attention modules let the
    layer's cache compute attention when it has an ``attend`` method, as kvfn's per-head batch
    caches (``kvfn.serving.batch.BatchHeadPartsKVCache``) need; with any other cache it computes
    exactly what ``model`` does. TypeError if a layer's attention does not call mlx-lm's
    ``scaled_dot_product_attention``."""

    def wrap(index: int, layer: nn.Module) -> nn.Module:
        name = _attention_name(layer, index)
        attn = copy.copy(getattr(layer, name))
        if not _calling_attend(attn):
            raise TypeError(
                f"layer {index}: {type(attn).__name__} computes attention itself, not through "
                "mlx-lm's scaled_dot_product_attention, so kvfn cannot run it per head part"
            )
        layer = copy.copy(layer)
        layer[name] = attn
        return layer

    return _own_copy(model, wrap)


class _MaskedAttention(nn.Module):
    """An attention module called with its own layer's mask, built from the cache it gets."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def __call__(self, x, mask=None, cache=None, *args, **kwargs):
        token = _current.set(cache)
        try:
            return self.inner(x, cache.attention_mask(x.shape[1]), cache, *args, **kwargs)
        finally:
            _current.reset(token)


class _QueryTap(nn.Module):
    """Wraps an attention's rope: the first call of a forward pass rotates the queries (read
    before and after RoPE)."""

    def __init__(self, rope):
        super().__init__()
        self.rope = rope

    def __call__(self, x, *args, **kwargs):
        out = self.rope(x, *args, **kwargs)
        adapter = _current.get()
        if adapter is not None and adapter.queries is None:
            adapter.queries, adapter.queries_in = out, x
        return out


def _first_attr(module, names, what: str, index: int):
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, int):
            return value
    raise TypeError(
        f"kvfn cannot thread layer {index}: its attention module {type(module).__name__} has no "
        f"{what} attribute ({' / '.join(names)})"
    )


def _attention_name(layer: nn.Module, index: int) -> str:
    for name in ATTENTION_NAMES:
        if isinstance(getattr(layer, name, None), nn.Module):
            return name
    raise TypeError(
        f"kvfn cannot thread layer {index} ({type(layer).__name__}): no attention module "
        f"named {' / '.join(ATTENTION_NAMES)}"
    )


def sliding_windows_of(model: nn.Module) -> tuple[Optional[int], ...]:
    """Per layer: None for full attention, the window for a sliding-window layer."""
    caches = (
        model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]
    )
    out = []
    for i, c in enumerate(caches):
        if type(c) is KVCache:
            out.append(None)
        elif type(c) is RotatingKVCache and c.keep == 0:
            out.append(c.max_size)
        else:
            raise TypeError(
                f"kvfn cannot thread {type(model).__module__}: layer {i} uses "
                f"{type(c).__name__}, which kvfn does not support"
            )
    return tuple(out)


def _path_to(module: nn.Module, first, path=()) -> Optional[tuple]:
    """Keys from ``module`` to the list holding the layer ``first``."""
    for key, child in module.items():
        if isinstance(child, list) and any(x is first for x in child):
            return (*path, key)
        if isinstance(child, nn.Module):
            found = _path_to(child, first, (*path, key))
            if found:
                return found
    return None


def _own_copy(model: nn.Module, wrap_layer) -> nn.Module:
    """A shallow copy of ``model`` down to its layers list, whose layers are ``wrap_layer``'s
    copies; every module not on that path (and so every weight) is shared. ``model.layers`` may
    be a slice of the stored list (mlx-lm's pipeline models): its layers are found by identity."""
    layers = list(model.layers)
    path = _path_to(model, layers[0]) if layers else None
    if path is None:
        raise TypeError(f"kvfn cannot find the layers list of {type(model).__name__}")
    root = node = copy.copy(model)
    for key in path[:-1]:
        node[key] = copy.copy(node[key])
        node = node[key]
    wrapped = {id(layer): wrap_layer(i, layer) for i, layer in enumerate(layers)}
    node[path[-1]] = [wrapped.get(id(x), x) for x in node[path[-1]]]
    return root


def vocab_size(model: nn.Module) -> Optional[int]:
    """The token ids ``model`` embeds (its config's ``vocab_size``, else its first embedding's
    rows); None if neither is found."""
    size = getattr(getattr(model, "args", None), "vocab_size", None)
    if isinstance(size, int):
        return size
    for _, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.QuantizedEmbedding)):
            return module.weight.shape[0]
    return None


def check_ids(tokens, vocab: Optional[int]) -> None:
    """Raise a ValueError if a token id (an mx.array's, read on the host, or a list's) lies
    outside [0, vocab): an embedding reads past its table there (on the CPU, a crash)."""
    if vocab is None or (not isinstance(tokens, mx.array) and not tokens):
        return
    if isinstance(tokens, mx.array):
        lo, hi = mx.stack([tokens.min(), tokens.max()]).tolist()
    else:
        lo, hi = min(tokens), max(tokens)
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise ValueError(f"token id {bad} is outside the model's vocabulary [0, {vocab})")


def _check_tokens(tokens, states) -> mx.array:
    if not isinstance(tokens, mx.array):
        raise TypeError(
            f"tokens must be an mx.array of shape (batch, n), got {type(tokens).__name__}"
        )
    if tokens.ndim != 2 or tokens.shape[1] < 1:
        raise ValueError(
            f"tokens must have shape (batch, n >= 1), got {tuple(tokens.shape)}; "
            "a single token is mx.array([[token]])"
        )
    if not mx.issubdtype(tokens.dtype, mx.integer):
        raise TypeError(f"tokens must be integer ids, got dtype {tokens.dtype}")
    batch = states[0].offset.shape[0]
    if tokens.shape[0] != batch:
        raise ValueError(f"tokens have batch {tokens.shape[0]} but the states hold {batch}")
    return tokens.astype(mx.int32)  # argmax gives uint32: one dtype, one trace


def _check_layer(state: kv.State, i: int, kv_heads: int, head_dim: int) -> None:
    B, H, _, D = state.keys.shape
    if (H, D) != (kv_heads, head_dim) or state.values.shape[:2] != (B, H):
        raise ValueError(
            f"state {i} holds keys {tuple(state.keys.shape)} and values "
            f"{tuple(state.values.shape)}; layer {i} has {kv_heads} KV heads of dimension "
            f"{head_dim}"
        )
    if not mx.issubdtype(state.keys.dtype, mx.floating):
        raise TypeError(f"state {i} holds {state.keys.dtype} keys; a KV cache is floating point")


def _at_least_zero(name: str, value, types, what: str):
    """``value`` if it is a finite ``types`` (not a bool) >= 0, else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, types) or not 0 <= value < float("inf"):
        raise ValueError(f"{name} must be {what} >= 0, got {value!r}")
    return value


class FunctionalModel:
    """An mlx-lm model as pure functions of (tokens, layer states)."""

    def __init__(self, model: nn.Module, *, compile_after: int = 0,
                 trace_slack: float = TRACE_SLACK):  # fmt: skip
        """``compile_after``: the compiled steps run their first ``compile_after`` calls at each
        layout and shapes eagerly (the same function, not traced) and trace at the next, so a
        shape met once (a prompt length's own buckets) costs no compilation; 0 traces at once.
        ``trace_slack``: how much more memory (a fraction) a decode may give a prompt's ragged
        layers to run in a trace made before (``decode``); 0 pads none."""
        if not isinstance(model, nn.Module) or not hasattr(model, "layers"):
            raise TypeError(f"FunctionalModel takes an mlx-lm model, got {type(model).__name__}")
        self.compile_after = _at_least_zero("compile_after", compile_after, int, "an int")
        self.trace_slack = float(_at_least_zero("trace_slack", trace_slack, (int, float),
                                                "a number"))  # fmt: skip
        self._calls: dict = {}  # calls a layout and shapes have had, while compile_after holds
        self.model = model
        self.sliding_windows = sliding_windows_of(model)
        self._attn_names = [_attention_name(l, i) for i, l in enumerate(model.layers)]
        attn = [getattr(l, n) for l, n in zip(model.layers, self._attn_names)]
        for i, a in enumerate(attn):
            if not isinstance(a.get("rope"), nn.Module):
                raise TypeError(
                    f"kvfn cannot thread {type(model).__module__}: the attention module of layer "
                    f"{i} ({type(a).__name__}) applies no rope to cache offsets"
                )
        self.n_heads = [_first_attr(a, N_HEADS_NAMES, "query-head count", i) for i, a in enumerate(attn)]  # fmt: skip
        self.n_kv_heads = [_first_attr(a, N_KV_HEADS_NAMES, "KV-head count", i) for i, a in enumerate(attn)]  # fmt: skip
        self.scales = [float(a.scale) if hasattr(a, "scale") else None for a in attn]
        self.head_dims = [
            getattr(a, "head_dim", None) or a.k_proj.weight.shape[0] // h
            for a, h in zip(attn, self.n_kv_heads)
        ]
        self._hooked = [False] * len(model.layers)
        # the group of a tensor-parallel model (mlx-lm's Model.shard); None when unsharded
        self.group = head_group(attn, self.n_heads, self.n_kv_heads, self.head_dims)
        self._model = _own_copy(model, self._wrap_layer)
        self._compiled: dict = {}
        self._traces = 0
        self._sizes: dict = {}  # the sizes decode traces were made for (``_traced_sizes``)
        self._dtype = None
        self.vocab_size = vocab_size(model)

    def _wrap_layer(self, index: int, layer: nn.Module) -> nn.Module:
        name = self._attn_names[index]
        attn = copy.copy(getattr(layer, name))
        attn.rope = _QueryTap(attn.rope)
        self._hooked[index] = _calling_attend(attn)
        layer = copy.copy(layer)
        layer[name] = _MaskedAttention(attn)
        return layer

    def rope(self, layer: int) -> nn.Module:
        """The RoPE module of layer ``layer``'s attention (the model's own)."""
        return getattr(self.model.layers[layer], self._attn_names[layer]).rope

    @property
    def traces(self) -> int:
        """How many times a compiled step was traced: once per layout (the states' types and
        static fields, the lockstep and query slice) and array shapes and dtypes."""
        return self._traces

    # -- states -----------------------------------------------------------------------------
    @property
    def dtype(self) -> mx.Dtype:
        """The dtype the model writes into its KV cache (found by one token through mlx-lm)."""
        if self._dtype is None:
            cache = make_prompt_cache(self.model)
            self.model(mx.array([[0]]), cache=cache)
            self._dtype = next(c.keys.dtype for c in cache if getattr(c, "keys", None) is not None)
        return self._dtype

    def init_states(self, batch: int, capacity: int, dtype: Optional[mx.Dtype] = None) -> tuple:
        """Empty states, one per layer, each with room for ``capacity`` rows (``dtype``: the
        model's KV dtype unless given)."""
        dtype = dtype or self.dtype
        return tuple(
            kv.init(batch, h, d, capacity, dtype=dtype, sliding_window=w)
            for h, d, w in zip(self.n_kv_heads, self.head_dims, self.sliding_windows)
        )

    def _check_states(self, states) -> None:
        if not isinstance(states, (tuple, list)) or len(states) != len(self.sliding_windows):
            n = len(states) if isinstance(states, (tuple, list)) else type(states).__name__
            raise ValueError(f"{n} states for a model of {len(self.sliding_windows)} layers")
        for i, s in enumerate(states):
            if not layout.is_state(s):
                raise TypeError(f"state {i} is a {type(s).__name__}, not a kvfn state")
            if layout.of(s).per_head and not self._hooked[i]:
                raise TypeError(
                    f"layer {i} holds a head-partitioned state, but its attention module "
                    f"({type(self.model.layers[i]).__name__}) computes attention itself, not "
                    "through mlx-lm's scaled_dot_product_attention: kvfn cannot run it per head "
                    "group"
                )

    def _check_layers(self, states) -> None:
        """Each layer's batch against the first's, and each plain layer's heads, head_dim and
        dtype against the model's (for a compiled step, when it traces: each new layout or
        shape, not each call)."""
        for i, s in enumerate(states):
            if s.offset.shape != states[0].offset.shape:
                raise ValueError(
                    f"state {i} holds batch {s.offset.shape[0]}, state 0 batch "
                    f"{states[0].offset.shape[0]}"
                )
            if isinstance(s, kv.State):
                _check_layer(s, i, self.n_kv_heads[i], self.head_dims[i])

    def _prepare(self, tokens, states, check: bool = True, eager: bool = True,
                 bucket_rows: bool = False) -> tuple:  # fmt: skip
        """Checked tokens and states grown to take them (``grown``; ``bucket_rows``: capacities
        rounded up to a ``bucket``); ``check``: the token ids too (one host read)."""
        self._check_states(states)
        if eager:
            self._check_layers(states)
        tokens = _check_tokens(tokens, states)
        if check:
            check_ids(tokens, self.vocab_size)
        out = tuple(grown(s, tokens.shape[1], bucket_rows) for s in states)
        if not eager and any(a is not b for a, b in zip(out, states)):
            self._check_layers(states)  # the caller's shapes, before new buffers replace them
        return tokens, out

    # -- the pure forward pass ----------------------------------------------------------------
    @staticmethod
    def _lockstep(states) -> bool:
        """Whether every packed full-attention layer, and every packed part of plain rows of a
        head-partitioned layer, holds the same rows and capacity (known on the host: a packed
        state's row count is exact); then the layers also share the offset their rings derive
        from."""
        rows = set().union(*(layout.of(s).lockstep_rows(s) for s in states))
        return len(rows) == 1 and None not in next(iter(rows))

    def _run(self, tokens, states, scores=None, queries=None, lockstep=None):
        lockstep = self._lockstep(states) if lockstep is None else lockstep
        adapters, call = [], Call(lockstep)
        for i, state in enumerate(states):
            scored = queries is not None and self.sliding_windows[i] is None
            adapter = adapter_of(state)
            adapters.append(adapter(state, self.n_heads[i], call, self.scales[i],
                                    scores[i] if scored else None,
                                    queries if scored else None))  # fmt: skip
        logits = self._model(tokens, cache=adapters)
        offset = adapters[0].state.offset  # equal in every layer and part: one array for all
        return logits, tuple(tree.with_offset(a.state, offset) for a in adapters), adapters

    def forward(self, tokens, states, *, check_ids: bool = True) -> tuple:
        """Eager: logits (B, n, vocab) and new states. ``check_ids``: raise a ValueError for a
        token id outside the vocabulary (one host read; a caller that checked them passes
        False)."""
        tokens, states = self._prepare(tokens, states, check_ids)
        logits, new_states, _ = self._run(tokens, states)
        return logits, new_states

    def scored_forward(self, tokens, states, scores, queries: QuerySlice, *,
                       check_ids: bool = True) -> tuple:  # fmt: skip
        """Eager ``forward`` that also adds the attention of the ``queries`` rows over every key
        to ``scores`` (one (B, n_heads, capacity) array a layer), or their moments (one
        (B, n_heads, head_dim + 2, head_dim) array): (logits, states, scores)."""
        tokens, states, scores = self._prepare_scored(tokens, states, scores, queries, check_ids)
        logits, new_states, adapters = self._run(tokens, states, scores, queries)
        return logits, new_states, self._scores_out(adapters, scores)

    def _scores_out(self, adapters, scores) -> tuple:
        return tuple(a.scores if a.query_slice is not None else s for a, s in zip(adapters, scores))

    def _prepare_scored(self, tokens, states, scores, queries, check: bool,
                        eager: bool = True) -> tuple:  # fmt: skip
        if any(not isinstance(s, kv.State) for s in states):
            raise TypeError("a scored step needs plain states (score before partitioning)")
        old = [s.capacity for s in states] if isinstance(states, (tuple, list)) else None
        tokens, states = self._prepare(tokens, states, check, eager)
        sums = ("attention", "max_attention")  # scores over every slot
        grows = isinstance(queries, QuerySlice) and queries.statistic in sums
        if grows and old is not None and len(scores) == len(states):  # states grew: so do scores
            scores = tuple(
                (
                    mx.pad(s, [(0, 0)] * (s.ndim - 1) + [(0, st.capacity - c)])
                    if st.capacity > c
                    else s
                )
                for s, st, c in zip(scores, states, old)
            )
        self._check_scoring(states, scores, queries, tokens.shape[1])
        return tokens, states, tuple(scores)

    def _check_scoring(self, states, scores, queries, n: int) -> None:
        if None in self.scales:
            raise TypeError("kvfn scoring needs each attention module's softmax `scale`")
        if not isinstance(queries, QuerySlice) or not 0 <= queries.start < queries.stop <= n:
            raise ValueError(f"queries must be a QuerySlice within the {n} tokens, got {queries}")
        if len(scores) != len(states):
            raise ValueError(f"{len(scores)} score arrays for {len(states)} layers")
        w = queries.stop - queries.start
        for i, (s, st) in enumerate(zip(scores, states)):
            want = (st.keys.shape[0], self.n_heads[i], st.capacity)
            if queries.statistic == "moments":
                want = (*want[:2], self.head_dims[i] + 2, self.head_dims[i])
            elif queries.statistic == "queries":
                want = (*want[:2], w, self.head_dims[i])
            elif queries.statistic == "reconstruction":
                want = (*want[:2], queries.rows[2] - queries.rows[1])
            elif (
                s.ndim == 4 and queries.statistic == "attention"
            ):  # one row per query (kvfn.heads profiles heads with them)
                want = (*want[:2], w, want[2])
            if tuple(s.shape) != want:
                raise ValueError(f"scores[{i}] must have shape {want}, got {tuple(s.shape)}")

    # -- compiled steps -------------------------------------------------------------------------
    def _compiled_step(self, key, fn):
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compiled[key] = mx.compile(fn, inputs=self._model.state)
        return compiled

    def _cold(self, key, tokens, flat, scores) -> bool:
        """Whether this call runs eagerly: one of the first ``compile_after`` at its layout and
        shapes (what a trace is specialised to)."""
        if not self.compile_after:
            return False
        shapes = tuple((k, a.shape, a.dtype) for k, a in tree_flatten(list(flat)))
        signature = (key, tokens.shape, shapes, tuple(s.shape for s in scores))
        calls = self._calls[signature] = self._calls.get(signature, 0) + 1
        return calls <= self.compile_after

    def step(self, tokens, states, *, check_ids: bool = True) -> tuple:
        """Compiled: logits of the last position (B, vocab) and new states, for n >= 1 tokens.
        Traced once per layout and shapes (``traces``): a decode loop traces once per
        capacity, and capacities grow in buckets. ``check_ids`` as in ``forward``."""
        return self._step(tokens, states, check_ids, bucket_rows=False)

    def _step(self, tokens, states, check_ids: bool, bucket_rows: bool) -> tuple:
        tokens, states = self._prepare(tokens, states, check_ids, eager=False,
                                       bucket_rows=bucket_rows)  # fmt: skip
        if bucket_rows:
            states = self._traced_sizes(tokens, states)
        return self._compiled_call(tokens, states)[:2]

    def _traced_sizes(self, tokens, states) -> tuple:
        """States whose kind has a ``Layout.size`` (a ragged layer's slots, set by its prompt's
        allocation: the layers of a new prompt seldom all fall in the buckets of an earlier
        one) padded to the sizes of a decode this model has traced for the same kinds and
        other layers' shapes: the cheapest of those at least its own that hold at most
        ``trace_slack`` more bytes. Else to the layer by layer largest of its own and the latest
        such trace's, within the same slack, so that the next prompt finds the trace this one
        makes; else its own. The rows kept are the same."""
        layouts = [layout.of(s) for s in states]
        sizes = tuple(lay.size(s) for lay, s in zip(layouts, states))
        if all(z is None for z in sizes):
            return states
        per_size = tuple(0 if z is None else lay.unit_bytes(s)
                         for lay, s, z in zip(layouts, states, sizes))  # fmt: skip
        cost = lambda zs: sum(z * b for z, b in zip(zs, per_size) if z is not None)  # noqa: E731
        shapes = lambda s: tuple((k, a.shape) for k, a in tree_flatten(tree.flatten(s)[0]))  # noqa
        # a trace's sizes are for the same kinds and the other layers' shapes
        fixed = tuple(
            type(s) if z is not None else (type(s), shapes(s)) for s, z in zip(states, sizes)
        )
        key = (tokens.shape, fixed, per_size)
        known = self._sizes.setdefault(key, [])
        if sizes in known:  # a decode loop's every step after its first
            return states
        limit = (1 + self.trace_slack) * cost(sizes)
        above = lambda zs: all(a is None or a >= b for a, b in zip(zs, sizes))  # noqa: E731
        target = min((zs for zs in known if above(zs) and cost(zs) <= limit), key=cost,
                     default=None)  # fmt: skip
        if target is None:
            widened = (tuple(None if a is None else max(a, b) for a, b in zip(zs, sizes))
                       for zs in reversed(known))  # fmt: skip
            target = next((zs for zs in widened if cost(zs) <= limit), sizes)
            known.append(target)
            del known[:-KNOWN_SIZES]
        return tuple(s if z == t else lay.padded(s, t)
                     for lay, s, z, t in zip(layouts, states, sizes, target))  # fmt: skip

    def decode(self, tokens, states) -> tuple:
        """``step`` for one new token per sequence: tokens (B, 1), each state's capacity first
        rounded up to a ``bucket`` (``grown``), so that prompts of different lengths decode
        through one trace a bucket. Its ids are not checked: a host read each
        step would stall the loop (the token is most often the model's own)."""
        if isinstance(tokens, mx.array) and tokens.ndim == 2 and tokens.shape[1] != 1:
            raise ValueError(
                f"decode takes one token per sequence, shape (batch, 1); got "
                f"{tuple(tokens.shape)} (use step for a chunk)"
            )
        return self._step(tokens, states, check_ids=False, bucket_rows=True)

    def scored_step(self, tokens, states, scores, queries: QuerySlice, *,
                    check_ids: bool = True) -> tuple:  # fmt: skip
        """Compiled ``scored_forward``: (logits of the last position, states, scores)."""
        tokens, states, scores = self._prepare_scored(tokens, states, scores, queries, check_ids,
                                                      eager=False)  # fmt: skip
        return self._compiled_call(tokens, states, scores, queries)

    def _compiled_call(self, tokens, states, scores=(), queries=None) -> tuple:
        flat, static, host = zip(*(tree.flatten(s) for s in states))
        lockstep = self._lockstep(states)

        def step(tokens, flat, scores):
            states_in = tuple(map(tree.unflatten, flat, static))
            self._check_layers(states_in)
            logits, out, adapters = self._run(tokens, states_in, scores, queries, lockstep)
            new_scores = self._scores_out(adapters, scores) if queries is not None else ()
            return logits[:, -1], [tree.flatten(s)[0] for s in out], list(new_scores)

        def run(tokens, flat, scores):  # runs only when mx.compile traces
            self._traces += 1
            return step(tokens, flat, scores)

        # what the trace closes over; mx.compile keeps a trace per input shapes and dtypes itself
        key = (queries, lockstep, static)
        fn = step if self._cold(key, tokens, flat, scores) else self._compiled_step(key, run)
        logits, out, new_scores = fn(tokens, list(flat), list(scores))
        n = tokens.shape[1]
        new_states = tuple(
            tree.unflatten(o, st, tree.advanced(st, h, n)) for o, st, h in zip(out, static, host)
        )
        return logits, new_states, tuple(new_scores)
