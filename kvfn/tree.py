"""The state types a model wrapper threads, as arrays plus a static part (for ``mx.compile``)
plus what the host knows (row bounds), and back.

``flatten(state) -> (arrays, static, host)``: ``static`` is hashable and shapes a trace;
``host`` is what only the host knows (``max_rows``, ``dense``), which a trace must not depend
on. ``unflatten(arrays, static, host=None)`` rebuilds the state (``None``: inside a trace).
"""

from . import cache as kv
from . import partitioned as part


class _Plain:
    flatten = staticmethod(kv.flatten)

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


class _Partitioned:
    flatten = staticmethod(part.flatten)

    @staticmethod
    def host(state):
        return part.bounds(state)

    @staticmethod
    def unflatten(arrays, static, host):
        return part.unflatten(arrays, static, host or (None,) * len(arrays))

    @staticmethod
    def advanced(host, n):
        return tuple(None if b is None else b + n for b in host)


KINDS = {kv.State: _Plain, part.HeadPartitionedKVCache: _Partitioned}


def kind(state):
    try:
        return KINDS[type(state)]
    except KeyError:
        raise TypeError(f"{type(state).__name__} is not a kvfn layer state") from None


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
    if isinstance(arrays, dict):
        return [a for v in arrays.values() for a in leaves(v)]
    if isinstance(arrays, (list, tuple)):
        return [a for v in arrays for a in leaves(v)]
    return [arrays]


def arrays(states) -> list:
    """Every array of a state or a sequence of states (e.g. for ``mx.eval``)."""
    if type(states) in KINDS:
        return leaves(flatten(states)[0])
    return [a for s in states for a in arrays(s)]
