"""The state types a model wrapper threads, as arrays plus a static part (for ``mx.compile``)
plus what the host knows (row bounds), and back, by each kind's layout (``layout.of``); and
saving and loading them.

``flatten(state) -> (arrays, static, host)``: ``static`` is hashable and shapes a trace;
``host`` is what only the host knows (``max_rows``, ``dense``), which a trace must not depend
on. ``unflatten(arrays, static, host=None)`` rebuilds the state (``None``: inside a trace).
"""

import mlx.core as mx

from . import cache, layout, partitioned  # noqa: F401  (their layouts: every kind a tree may hold)
from .layout import LAYOUTS


def stackable(state) -> bool:
    """Whether layers of ``state``'s kind join in one batch (``stack``)."""
    k = LAYOUTS.get(type(state))
    return k is not None and k.stack is not None


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
    return states[0] if len(states) == 1 else layout.of(states[0]).stack(list(states))


def flatten(state) -> tuple:
    k = layout.of(state)
    arrays, static = k.flatten(state)
    return arrays, (type(state), static), k.host(state)


def unflatten(arrays, static, host=None):
    cls, st = static
    return LAYOUTS[cls].unflatten(arrays, st, host)


def advanced(static, host, n: int):
    """``host`` after ``n`` rows were appended."""
    return LAYOUTS[static[0]].advanced(host, n)


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
    """``state`` with ``offset`` as its offset array (each part's, for a partitioned layer). The
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
    if layout.is_state(states):
        return leaves(flatten(states)[0])
    return [a for s in states for a in arrays(s)]


def _encode(static, host) -> dict:
    cls, st = static
    kind = LAYOUTS[cls]
    return dict(kind=kind.name, **kind.encode(st, host))


def _decode(saved: dict) -> tuple:
    kind = layout.named(saved["kind"])
    cls = next(c for c, k in LAYOUTS.items() if k is kind)
    st, host = kind.decode(saved)
    return (cls, st), host


def _named(prefix: str, arrays) -> dict:
    if isinstance(arrays, dict):
        return {f"{prefix}.{k}": v for k, v in arrays.items()}
    return {k: v for i, a in enumerate(arrays) for k, v in _named(f"{prefix}.{i}", a).items()}


def _unnamed(prefix: str, flat: dict, static) -> dict | list:
    cls, st = static
    return LAYOUTS[cls].unnamed(prefix, flat, st)


def save(path, states, metadata: dict | None = None) -> None:
    """Write layer states of any kind (plain, partitioned, slots) to a .safetensors file, with
    what rebuilds them (kinds, heads, sizes, host bounds) in its metadata."""
    import json

    arrays, saved = {}, []
    for i, s in enumerate(states):
        as_kind = layout.of(s).saved_as
        if as_kind is not None:
            s = layout.of(s).to_saved(s)
        flat, static, host = flatten(s)
        arrays.update(_named(str(i), flat))
        saved.append(_encode(static, host) | ({"as": as_kind} if as_kind else {}))
    meta = {"kvfn_states": json.dumps(saved), **{k: str(v) for k, v in (metadata or {}).items()}}
    mx.save_safetensors(str(path), arrays, metadata=meta)


def load(path) -> tuple[tuple, dict]:
    """The states ``save`` wrote, and the file's other metadata."""
    import json

    flat, meta = mx.load(str(path), return_metadata=True)
    if "kvfn_states" not in meta:
        raise ValueError(f"{path} holds no kvfn states (no 'kvfn_states' metadata)")
    saved_as = {k.saved_as: k for k in LAYOUTS.values() if k.saved_as is not None}
    states = []
    for i, entry in enumerate(json.loads(meta.pop("kvfn_states"))):
        static, host = _decode(entry)
        state = LAYOUTS[static[0]].loaded(unflatten(_unnamed(str(i), flat, static), static, host))
        if "as" in entry:
            if entry["as"] not in saved_as:
                raise ValueError(f"{path}: layer {i} was saved as {entry['as']!r}, a layout "
                                 f"this kvfn does not know (known: {sorted(saved_as)})")  # fmt: skip
            state = saved_as[entry["as"]].from_saved(state)
        states.append(state)
    return tuple(states), meta
