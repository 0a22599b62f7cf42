"""The state types a model wrapper threads, as arrays plus a static part (for ``mx.compile``)
plus what the host knows (row bounds), and back.

``flatten(state) -> (arrays, static, host)``: ``static`` is hashable and shapes a trace;
``host`` is what only the host knows (``max_rows``, ``dense``), which a trace must not depend
on. ``unflatten(arrays, static, host=None)`` rebuilds the state (``None``: inside a trace).
"""

import mlx.core as mx

from . import cache as kv
from . import partitioned as part


class _Plain:
    flatten = staticmethod(kv.flatten)
    stack = staticmethod(kv.stack)

    @staticmethod
    def host(state):
        return state.max_rows, state.dense

    @staticmethod
    def unflatten(arrays, static, host):
        return kv.unflatten(arrays, static, *(host or (None, False)))

    @staticmethod
    def advanced(host, n):
        max_rows, dense = host
        return (None if max_rows is None else max_rows + n), dense

    @staticmethod
    def loaded(state):
        """A file written before free slots held their next positions (EMPTY there) gets the
        tail rebuilt, so appends to it are seen; a newer file is left as it was."""
        return state.replace(positions=kv.tail_positions(state.positions, state.offset, state.rows))


class _Partitioned:
    flatten = staticmethod(part.flatten)
    stack = staticmethod(part.stack)

    @staticmethod
    def host(state):
        return part.bounds(state)

    @staticmethod
    def unflatten(arrays, static, host):
        return part.unflatten(arrays, static, host or (None,) * len(arrays))

    @staticmethod
    def advanced(host, n):
        return tuple(None if b is None else b + n for b in host)

    @staticmethod
    def loaded(state):
        groups = (_Plain.loaded(g) if type(g) is kv.State else g for g in state.groups)
        return state.replace(groups=tuple(groups))


# A kind may be saved as another kind's state: it then names itself (``saved_as``) and gives
# ``to_saved`` (a state ``save`` encodes) and ``from_saved`` (back).
KINDS = {kv.State: _Plain, part.HeadPartitionedKVCache: _Partitioned}


def kind_name(cls) -> str:
    """A kind's name in saved files, where the kind gives one (``name``)."""
    return getattr(KINDS.get(cls), "name", "")


def kind(state):
    try:
        return KINDS[type(state)]
    except KeyError:
        raise TypeError(f"{type(state).__name__} is not a kvfn layer state") from None


def stackable(state) -> bool:
    """Whether layers of ``state``'s kind join in one batch (``stack``)."""
    return hasattr(KINDS.get(type(state)), "stack")


def stack(states: list):
    """One batch from the same layer's states of several sequences, by their kind's own
    ``stack`` (plain, ragged, partitioned; one state is its own batch). Kinds mixed, or a kind
    that does not stack, are refused by name."""
    if not states:
        raise ValueError("stack needs at least one state")
    kinds = sorted({type(s).__name__ for s in states})
    if len(kinds) > 1:
        raise ValueError(f"cannot stack layers of different kinds {kinds}")
    if not stackable(states[0]):
        raise TypeError(f"{kinds[0]} layers do not stack")
    return states[0] if len(states) == 1 else kind(states[0]).stack(list(states))


def flatten(state) -> tuple:
    k = kind(state)
    arrays, static = k.flatten(state)
    return arrays, (type(state), static), k.host(state)


def unflatten(arrays, static, host=None):
    cls, st = static
    return KINDS[cls].unflatten(arrays, st, host)


def advanced(static, host, n: int):
    """``host`` after ``n`` rows were appended."""
    return KINDS[static[0]].advanced(host, n)


def leaves(arrays) -> list:
    """The arrays of a flattened state (dicts and lists of them)."""
    if isinstance(arrays, dict):
        return [a for v in arrays.values() for a in leaves(v)]
    if isinstance(arrays, (list, tuple)):
        return [a for v in arrays for a in leaves(v)]
    return [arrays]


def _replaced(arrays, key: str, value):
    if isinstance(arrays, dict):
        return {k: value if k == key else _replaced(v, key, value) for k, v in arrays.items()}
    if isinstance(arrays, (list, tuple)):
        return [_replaced(v, key, value) for v in arrays]
    return arrays


def with_offset(state, offset: mx.array):
    """``state`` with ``offset`` as its offset array (each group's, for a partitioned layer). The
    layers of a model hold equal offsets; one array for all of them is one that the next step's
    RoPE reads, so no layer's offset grows a lazy chain that no step evaluates."""
    arrays, static, host = flatten(state)
    new = _replaced(arrays, "offset", offset)
    if all(a is b for a, b in zip(leaves(arrays), leaves(new))):
        return state
    return unflatten(new, static, host)


def arrays(states) -> list:
    """Every array of a state or a sequence of states (e.g. for ``mx.eval``). A pipelined
    decode loop should ``mx.async_eval`` only its token: queued arrays stay alive until their
    step completes, so the next step's writes into them would copy."""
    if type(states) in KINDS:
        return leaves(flatten(states)[0])
    return [a for s in states for a in arrays(s)]


def _encode(static, host) -> dict:
    cls, st = static
    if cls is kv.State:
        (window, packed), (max_rows, dense) = st, host
        return dict(kind="plain", sliding_window=window, packed=packed, max_rows=max_rows,
                    dense=dense)  # fmt: skip
    if kind_name(cls) == "ragged":
        room, kept = host
        return dict(kind="ragged", room=room, kept=kept)
    heads, kinds = st
    groups = []
    for (gcls, gst), bound in zip(kinds, host):
        if gcls is kv.State:
            groups.append(dict(kind="plain", sliding_window=gst[0], packed=gst[1], max_rows=bound))
        else:
            groups.append(dict(kind="ring", sink=gst[0], recent=gst[1], full=gst[2]))
    return dict(kind="partitioned", heads=[list(h) for h in heads], groups=groups)


def _decode(layout: dict) -> tuple:
    if layout["kind"] == "plain":
        static = (kv.State, (layout["sliding_window"], layout["packed"]))
        return static, (layout["max_rows"], layout["dense"])
    if layout["kind"] == "ragged":
        cls = next(c for c in KINDS if kind_name(c) == "ragged")
        return (cls, ()), (layout["room"], layout["kept"])
    kinds, bounds = [], []
    for g in layout["groups"]:
        if g["kind"] == "plain":
            kinds.append((kv.State, (g["sliding_window"], g["packed"])))
            bounds.append(g["max_rows"])
        else:
            kinds.append((part.StreamingRing, (g["sink"], g["recent"], g.get("full", False))))
            bounds.append(None)
    heads = tuple(tuple(h) for h in layout["heads"])
    return (part.HeadPartitionedKVCache, (heads, tuple(kinds))), tuple(bounds)


def _named(prefix: str, arrays) -> dict:
    if isinstance(arrays, dict):
        return {f"{prefix}.{k}": v for k, v in arrays.items()}
    return {k: v for i, a in enumerate(arrays) for k, v in _named(f"{prefix}.{i}", a).items()}


def _unnamed(prefix: str, flat: dict, static) -> dict | list:
    cls, st = static
    if cls is part.HeadPartitionedKVCache:
        return [_unnamed(f"{prefix}.{i}", flat, k) for i, k in enumerate(st[1])]
    if cls is kv.State:
        return {f: flat[f"{prefix}.{f}"] for f in kv.ARRAY_FIELDS}
    if kind_name(cls) == "ragged":
        return {f: flat[f"{prefix}.{f}"] for f in KINDS[cls].ARRAY_FIELDS}
    ring = {f: flat[f"{prefix}.{f}"] for f in part.rg.ARRAY_FIELDS if f"{prefix}.{f}" in flat}
    if "since" not in ring:  # written when rings stored a position per slot
        ring["since"] = part.rg.since_of(flat[f"{prefix}.positions"], ring["offset"], st[0])
    return ring


def save(path, states, metadata: dict | None = None) -> None:
    """Write layer states of any kind (plain, partitioned, slots) to a .safetensors file, with
    what rebuilds them (kinds, heads, sizes, host bounds) in its metadata."""
    import json

    arrays, layouts = {}, []
    for i, s in enumerate(states):
        as_kind = getattr(kind(s), "saved_as", None)
        if as_kind is not None:
            s = kind(s).to_saved(s)
        flat, static, host = flatten(s)
        arrays.update(_named(str(i), flat))
        layouts.append(_encode(static, host) | ({"as": as_kind} if as_kind else {}))
    meta = {"kvfn_states": json.dumps(layouts), **{k: str(v) for k, v in (metadata or {}).items()}}
    mx.save_safetensors(str(path), arrays, metadata=meta)


def load(path) -> tuple[tuple, dict]:
    """The states ``save`` wrote, and the file's other metadata."""
    import json

    flat, meta = mx.load(str(path), return_metadata=True)
    if "kvfn_states" not in meta:
        raise ValueError(f"{path} holds no kvfn states (no 'kvfn_states' metadata)")
    saved_as = {k.saved_as: k for k in KINDS.values() if hasattr(k, "saved_as")}
    states = []
    for i, layout in enumerate(json.loads(meta.pop("kvfn_states"))):
        static, host = _decode(layout)
        state = KINDS[static[0]].loaded(unflatten(_unnamed(str(i), flat, static), static, host))
        if "as" in layout:
            if layout["as"] not in saved_as:
                raise ValueError(f"{path}: layer {i} was saved as {layout['as']!r}, a layout "
                                 f"this kvfn does not know (known: {sorted(saved_as)})")  # fmt: skip
            state = saved_as[layout["as"]].from_saved(state)
        states.append(state)
    return tuple(states), meta
