"""One mutable shell around an immutable kvfn layer state: mlx-lm's cache protocol for any kind.

mlx-lm's models and its ``BatchGenerator`` change their cache objects in place; kvfn's states
never change. A ``StateCache`` holds one layer's state (of one sequence or a batch of them) and
replaces it, call by call, with what the kind's pure functions return: an append through the
kind's adapter (``kvfn.adapters``, the code that runs the kind in ``FunctionalModel``'s
forward calls), growth by the one capacity rule (``layout.grown``), a trim, and batch
membership by the kind's layout (``stack`` joins sequences, ``take`` keeps some). Nothing here
names a kind. The model must hand the cache its attention (``kvfn.wrapper.attending_copy``):
a per-head kind keeps its own rows per head, which no one mask of mlx-lm's covers.
"""

import mlx.core as mx

from .. import adapters
from ..states import layout, tree


class StateCache:
    """mlx-lm's cache protocol over ``layer_state``, a kvfn layer state: one sequence's layer, or
    a batch's (``merge``). ``state`` is mlx-lm's: the arrays it holds."""

    def __init__(self, state):
        layout.of(state)  # a TypeError for what is no kvfn layer state
        self.layer_state = state
        self._before = self._adapter = None

    # -- mlx-lm protocol ----------------------------------------------------------------------
    @property
    def offset(self) -> mx.array:
        return self.layer_state.offset

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        return None  # ``attend`` builds this layer's own mask from its state

    def update_and_fetch(self, keys, values):
        self._before = layout.grown(self.layer_state, keys.shape[2])
        adapter = adapters.adapter_of(self._before)(self._before, keys.shape[1], adapters.Call())
        fetched = adapter.update_and_fetch(keys, values)
        self.layer_state, self._adapter = adapter.state, adapter
        return fetched

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        if self._adapter is None:
            raise RuntimeError("a kvfn cache attends only after its update_and_fetch")
        n, call = queries.shape[2], adapters.Call()
        call.return_array = True
        before = adapters.adapter_of(self._before)(self._before, queries.shape[1], call)
        own = before.attention_mask(n)
        adapter, self._adapter, self._before = self._adapter, None, None
        return adapter.attend(queries, keys, values, scale=scale, mask=own, sinks=sinks)

    def prepare(self, *, lengths=None, right_padding=None, **kwargs):
        if right_padding is not None and any(right_padding):
            raise ValueError("kvfn's state caches take no right-padded prompt chunks")

    def finalize(self):
        pass

    @property
    def state(self) -> list:
        """The arrays of the held state (what mlx-lm evaluates)."""
        return tree.arrays(self.layer_state)

    def is_trimmable(self) -> bool:
        return layout.of(self.layer_state).trim is not None

    def trim(self, n: int) -> int:
        self.layer_state = layout.of(self.layer_state).trim(self.layer_state, n)
        return n

    def size(self) -> int:
        return layout.of(self.layer_state).kept(self.layer_state)[0]

    def empty(self) -> bool:
        return self.size() == 0

    @property
    def nbytes(self) -> int:
        return layout.of(self.layer_state).kept(self.layer_state)[1]

    # -- batch membership ---------------------------------------------------------------------
    @classmethod
    def merge(cls, caches) -> "StateCache":
        for i, c in enumerate(caches):
            if not isinstance(c, StateCache):
                raise TypeError(f"sequence {i}: cannot batch a {type(c).__name__} with kvfn "
                                "state caches")  # fmt: skip
        return cls(joined([c.layer_state for c in caches]))

    def filter(self, batch_indices):
        self.layer_state = taken(self.layer_state, list(batch_indices))

    def extend(self, other):
        if not isinstance(other, StateCache):
            raise TypeError(f"cannot extend a kvfn state cache with a {type(other).__name__}")
        self.layer_state = joined([self.layer_state, other.layer_state])

    def extract(self, idx: int) -> "StateCache":
        return StateCache(taken(self.layer_state, [idx]))


def joined(states: list):
    """One batch of the same layer's states of several sequences, by their kind's ``stack``."""
    kinds = {layout.of(s) for s in states}
    if len(kinds) != 1:
        names = sorted(k.__name__ for k in kinds)
        raise TypeError(f"cannot batch layers of different kinds: {names}")
    (kind,) = kinds
    if kind.stack is None or kind.take is None:
        raise TypeError(f"{type(states[0]).__name__} layers do not form batches (their layout "
                        "has no stack and take)")  # fmt: skip
    return kind.stack(list(states))


def taken(state, indices: list):
    """The sequences ``indices`` of a batch's layer, by its kind's ``take``."""
    kind = layout.of(state)
    if kind.take is None:
        raise TypeError(f"{type(state).__name__} layers do not form batches (no take)")
    return kind.take(state, mx.array(indices, mx.int32))
