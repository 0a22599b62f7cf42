"""A state kind's layout: what kvfn does with one kind of layer state, declared once beside its
dataclass (``cache``: plain, ``partitioned``, ``slots``, ``ragged``) and reached through ``of``.
Nothing outside ``kvfn.states`` asks which kind a state is.

A layout says how its states cross ``mx.compile`` (``flatten``: arrays, a hashable static part
that shapes a trace, and ``host``: what only the host knows; ``unflatten``; ``advanced``), how
they grow (``grown``, by the one capacity rule ``bucket``), what they keep (``kept``), how
layers of several sequences join and part (``stack``, ``take``), how tokens are dropped
(``trim``), how they are saved and loaded (``name``, ``encode``/``decode``, ``unnamed``; or
``saved_as`` another kind) and the head parts kvfn-server batches a per-head layer in
(``head_parts``). What runs a kind through mlx-lm's cache protocol in a forward call is
``kvfn.adapters.ADAPTERS[layout]``: the adapters build on the attention kernels and scores, which
build on the states; ``kvfn.serving.shell.StateCache`` holds a state between calls.
"""

from typing import ClassVar, Optional

GROWTH = 256  # the smallest step of a capacity (``bucket``)


def bucket(rows: int) -> int:
    """The capacity a compiled step gives ``rows`` rows: a multiple of ``GROWTH`` up to four of
    them, above that the next of four steps an octave (at most 25% more than ``rows``), so that
    prompts of any length decode through about four traces an octave. Doubling a bucket gives a
    bucket."""
    if rows <= 4 * GROWTH:
        return max(-(-rows // GROWTH), 1) * GROWTH
    step = 1 << ((rows - 1).bit_length() - 3)
    return -(-rows // step) * step


class Layout:
    """The base of every kind's layout: the defaults, and what each kind must give."""

    name: ClassVar[str] = ""  # the kind in saved files
    per_head: ClassVar[bool] = False  # heads keep different rows (attention through kvfn's own)
    saved_as: ClassVar[Optional[str]] = None  # saved as another kind: to_saved, from_saved
    ARRAY_FIELDS: ClassVar[tuple] = ()
    stack = None  # one batch from the same layer's states of several sequences, if they join
    take = None  # (state, indices): the sequences ``indices`` (an int32 array) of a batch's layer
    trim = None  # (state, n): the last n tokens of every sequence dropped, wherever their rows are
    rollback = None  # (state, n): the state before its last n appended rows, where exact

    @staticmethod
    def flatten(state) -> tuple:
        """(arrays, static)."""
        raise NotImplementedError

    @staticmethod
    def unflatten(arrays, static, host):
        """The state back; ``host`` None inside a trace."""
        raise NotImplementedError

    @staticmethod
    def host(state):
        raise NotImplementedError

    @staticmethod
    def advanced(host, n: int):
        """``host`` after ``n`` rows were appended."""
        raise NotImplementedError

    @staticmethod
    def grown(state, n: int, bucket_rows: bool = False):
        """``state`` with room for ``n`` more rows: unchanged if they fit, else a capacity at
        least double, a ``bucket``; ``bucket_rows``: a capacity that is no bucket is first
        rounded up to one."""
        raise NotImplementedError

    @staticmethod
    def size(state) -> Optional[int]:
        """The one buffer size, beyond the array shapes every layer of its kind shares, that a
        trace of this state is specialised to and ``padded`` can raise without changing what the
        state holds (a ragged layer's slots, which its allocation sets); None: none such."""
        return None

    @staticmethod
    def unit_bytes(state) -> int:
        """The bytes one unit of ``size`` takes."""
        raise TypeError("this kind's buffers are not padded to a size")

    @staticmethod
    def padded(state, size: int):
        """``state`` in a buffer of ``size`` (at least ``size(state)``), holding the same rows."""
        raise TypeError("this kind's buffers are not padded to a size")

    @staticmethod
    def kept(state) -> tuple[int, int]:
        """Rows a KV head stores (the mean over heads) and bytes stored."""
        raise NotImplementedError

    @staticmethod
    def lockstep_rows(state) -> set:
        """The (rows, capacity) pairs of the packed full-attention rows it holds, which the
        layers of a call share when they all agree (``FunctionalModel``'s lockstep)."""
        return set()

    @staticmethod
    def loaded(state):
        """A state read from a file, brought up to date."""
        return state

    @staticmethod
    def encode(static, host) -> dict:
        """What a saved file's metadata says to rebuild the state (``name`` added)."""
        raise NotImplementedError

    @staticmethod
    def decode(saved: dict) -> tuple:
        """(static, host) from ``encode``'s dict."""
        raise NotImplementedError

    @classmethod
    def head_parts(cls, state, heads: tuple) -> list:
        """One sequence's layer as the KV head parts ``heads``: per part a plain state of
        its rows and, for a part of streaming heads, its ring's (sink, recent) (else None).
        kvfn-server batches per-head layers in this form."""
        raise TypeError(f"{cls.__name__} layers do not split into head parts")

    @classmethod
    def unnamed(cls, prefix: str, flat: dict, static):
        """The arrays ``flatten`` gives, from a saved file's arrays named ``prefix.field``."""
        return {f: flat[f"{prefix}.{f}"] for f in cls.ARRAY_FIELDS}


LAYOUTS: dict[type, type[Layout]] = {}


def register(cls: type):
    """A class decorator: the ``Layout`` subclass it decorates is ``cls``'s."""

    def declare(layout: type[Layout]) -> type[Layout]:
        if not layout.name and layout.saved_as is None:
            raise ValueError(f"{layout.__name__} names no kind (name or saved_as)")
        LAYOUTS[cls] = layout
        return layout

    return declare


def of(state) -> type[Layout]:
    """The layout of ``state``'s kind; a TypeError names what is no kvfn layer state."""
    try:
        return LAYOUTS[type(state)]
    except KeyError:
        raise TypeError(f"{type(state).__name__} is not a kvfn layer state") from None


def named(name: str) -> type[Layout]:
    """The layout a saved file calls ``name``."""
    for layout in LAYOUTS.values():
        if layout.name == name:
            return layout
    known = sorted(layout.name for layout in LAYOUTS.values() if layout.name)
    raise ValueError(f"a layout this kvfn does not know: {name!r} (known: {known})")


def is_state(x) -> bool:
    return type(x) in LAYOUTS


def grown(state, n: int, bucket_rows: bool = False):
    """``state`` with room for ``n`` more rows, by its kind's rule (``Layout.grown``)."""
    return of(state).grown(state, n, bucket_rows)
