"""One home per state kind: a new kind declared in this file alone (its dataclass, its layout and
its adapter) runs through the model wrapper's compiled decode, save and load, ``to_mlx_cache``'s
refusal, kvfn-server's head parts and mlx-lm's continuous batching in the one mutable shell
(``kvfn.serving.shell.StateCache``), with no other module edited. ``Halves`` keeps a plain
layer's KV heads in two plain states (the first half, the rest)."""

from typing import ClassVar

import chex
import mlx.core as mx
import pytest

import kvfn
from kvfn import adapters
from kvfn.serving.batch import HeadPartsKVCache
from kvfn.serving.shell import StateCache
from kvfn.states import cache as kv
from kvfn.states import layout
from kvfn.wrapper import attending_copy
from tests.test_batch import batched, kvfn_decode
from tests.tiny import tiny_model


@chex.dataclass(frozen=True)
class Halves:
    front: kv.State
    back: kv.State

    @property
    def offset(self) -> mx.array:
        return self.front.offset


def split(state: kv.State, at: int) -> Halves:
    heads = state.keys.shape[1]
    return Halves(front=kv.take_heads(state, range(at)),
                  back=kv.take_heads(state, range(at, heads)))  # fmt: skip


def joined(h: Halves) -> kv.State:
    cat = {f: mx.concatenate([getattr(h.front, f), getattr(h.back, f)], axis=1)
           for f in ("keys", "values", "positions")}  # fmt: skip
    return h.front.replace(**cat)


@layout.register(Halves)
class HalvesLayout(layout.Layout):
    name = "halves"

    @staticmethod
    def flatten(h):
        (a, sa), (b, sb) = kv.flatten(h.front), kv.flatten(h.back)
        return [a, b], (sa, sb)

    @staticmethod
    def unflatten(arrays, static, host):
        host = host or ((None, False), (None, False))
        front, back = (kv.Layout.unflatten(x, s, hs) for x, s, hs in zip(arrays, static, host))
        return Halves(front=front, back=back)

    @staticmethod
    def host(h):
        return kv.Layout.host(h.front), kv.Layout.host(h.back)

    @staticmethod
    def advanced(host, n):
        return tuple(kv.Layout.advanced(x, n) for x in host)

    @staticmethod
    def grown(h, n, bucket_rows=False):
        front, back = (kv.grown(s, n, bucket_rows) for s in (h.front, h.back))
        return h if front is h.front and back is h.back else Halves(front=front, back=back)

    @staticmethod
    def stack(hs):
        return Halves(front=kv.stack([h.front for h in hs]), back=kv.stack([h.back for h in hs]))

    @staticmethod
    def take(h, indices):
        return Halves(front=kv.take(h.front, indices), back=kv.take(h.back, indices))

    @staticmethod
    def trim(h, n):
        return Halves(front=kv.trim(h.front, n), back=kv.trim(h.back, n))

    @staticmethod
    def kept(h):
        (r, a), (_, b) = kv.Layout.kept(h.front), kv.Layout.kept(h.back)
        return r, a + b

    @staticmethod
    def head_parts(h, heads):
        return kv.Layout.head_parts(joined(h), heads)

    @staticmethod
    def encode(static, host):
        return {"halves": [kv.Layout.encode(s, x) for s, x in zip(static, host)]}

    @staticmethod
    def decode(saved):
        parts = [kv.Layout.decode(x) for x in saved["halves"]]
        return tuple(s for s, _ in parts), tuple(x for _, x in parts)

    @staticmethod
    def unnamed(prefix, flat, static):
        return [kv.Layout.unnamed(f"{prefix}.{i}", flat, s) for i, s in enumerate(static)]


class HalvesAdapter:
    """mlx-lm's protocol over the joined layer, split again when the wrapper reads it."""

    def __init__(self, state: Halves, *args):
        self.at = state.front.keys.shape[1]
        self.inner = adapters.LayerAdapter(joined(state), *args)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def state(self) -> Halves:
        return split(self.inner.state, self.at)


adapters.ADAPTERS[HalvesLayout] = HalvesAdapter


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("llama")
    fm = kvfn.FunctionalModel(model)
    ids = mx.random.randint(0, 97, (1, 40), key=mx.random.key(3)).tolist()[0]
    plain, _ = kvfn.compact(fm, ids, kvfn.SnapKV(budget=16, window=4), max_new_tokens=8)
    at = fm.n_kv_heads[0] // 2
    return fm, ids, plain, tuple(split(s, at) for s in plain), model


def greedy(fm, states, token, n):
    out = []
    for _ in range(n):
        logits, states = fm.decode(token, states)
        token = mx.argmax(logits, axis=-1)[:, None]
        out.append(logits)
    return out, states


def test_a_new_kind_decodes_as_the_plain_layer_it_splits(setup):
    """The oracle: the halves decode exactly as the plain layer they split, through the
    compiled decode and past the capacity (both halves grow)."""
    fm, ids, plain, halves, _ = setup
    token = mx.array([[ids[-1]]])
    want, _ = greedy(fm, plain, token, 12)
    got, states = greedy(fm, halves, token, 12)
    for a, b in zip(want, got):
        assert mx.array_equal(a, b).item()
    assert all(type(s) is Halves for s in states)
    assert states[0].front.capacity >= 16 + 12
    assert kvfn.eviction.kept(states[0])[0] == states[0].front.max_rows


def test_a_new_kind_saves_and_loads(setup, tmp_path):
    fm, ids, _, halves, _ = setup
    kvfn.tree.save(tmp_path / "h.safetensors", halves)
    again, _ = kvfn.tree.load(tmp_path / "h.safetensors")
    token = mx.array([[ids[-1]]])
    assert all(type(s) is Halves for s in again)
    assert mx.array_equal(fm.decode(token, again)[0], fm.decode(token, halves)[0]).item()


def test_a_new_kind_is_refused_by_mlx_lm_interop_by_name(setup):
    with pytest.raises(ValueError, match="Halves"):
        kvfn.to_mlx_cache(setup[3])


def test_a_new_kind_forms_kvfn_servers_head_groups(setup):
    """The server's per-head batch form takes it through its layout's head parts: the same
    rows as the plain layer's."""
    _, _, plain, halves, _ = setup
    heads = ((0,), tuple(range(1, plain[0].keys.shape[1])))
    a = HeadPartsKVCache.from_state(halves[0], heads)
    b = HeadPartsKVCache.from_state(plain[0], heads)
    assert a.heads == b.heads == heads and a.rings == b.rings == [None, None]
    for x, y in zip(a.parts, b.parts):
        assert (x.offset, x.rows) == (y.offset, y.rows) and x.rows > 0
        for f in ("keys", "values", "positions"):
            assert mx.array_equal(getattr(x, f)[:, :, : x.rows], getattr(y, f)[:, :, : y.rows])


def test_a_new_kind_batches_in_mlx_lms_generator_through_the_one_shell(setup):
    """Two prompts of different lengths, each in halves, decode in one ``BatchGenerator`` batch
    (the second joining later, the first leaving last: stack, take) exactly as kvfn's decode
    of each alone; a layer grows past its room in the batch."""
    fm, ids, _, halves, model = setup
    other = ids[5:33]
    plain, _ = kvfn.compact(fm, other, kvfn.SnapKV(budget=12, window=4), max_new_tokens=2)
    at = halves[0].front.keys.shape[1]
    entries = [(halves, ids), (tuple(split(s, at) for s in plain), other)]
    steps = [10, 6]
    want = [kvfn_decode(fm, p, states, n) for (states, p), n in zip(entries, steps)]
    caches = [([StateCache(s) for s in states], prompt_ids[-1:]) for states, prompt_ids in entries]
    got, done = batched(attending_copy(model), caches, steps, join_at=2)
    assert got == want
    assert all(type(c.layer_state) is Halves for c in done[0])
    assert done[0][0].layer_state.front.capacity > halves[0].front.capacity
