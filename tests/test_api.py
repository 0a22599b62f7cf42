"""The public surface: import, limits, bad input, purity of the wrapper, no host sync."""

import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import kvfn
from kvfn import FunctionalModel, SnapKV, StreamingLLM
from kvfn import cache as kv
from tests.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def greedy_tokens(fm, token, states, steps):
    out = []
    for _ in range(steps):
        logits, states = fm.decode(token, states)
        token = mx.argmax(logits, axis=-1)[:, None]
        out.append(token.item())
    return out, states


# The public API as it stood before the library was grouped by role (stop 34): a name moved,
# renamed or dropped is a break for every user, so it shows here first.
API = [
    "AdaKV", "AdaKVzip", "ChunkKV", "CompactedKVCache", "Duo", "EMPTY", "EvictionResult",
    "ExpectedAttention", "FunctionalModel", "HeadPartitionedEvictionResult",
    "HeadPartitionedKVCache", "HeadPattern", "HeadSlotsKVCache", "KVzip", "Policy",
    "PositionPreservingKVCache", "PyramidKV", "QuantizedCompactedKVCache", "QuerySlice",
    "RaggedKVCache", "RandomRows", "SnapKV", "StreamingLLM", "StreamingRing", "bounded_decode",
    "cache", "compact", "compact_prompt_cache", "compact_states", "compact_steps", "distributed",
    "evict",
    "evict_prompt_cache", "evict_prompt_cache_by_head", "from_full", "from_mlx_cache", "init",
    "load_prompt_cache", "mask", "parse_policy", "partitioned", "prefill", "prefix_trim",
    "query_statistics", "ragged", "reconstruction_scores", "reconstruction_steps",
    "register_policy", "repeat_prompt", "reserve", "restrict", "ring", "scored_prefill", "slots",
    "snapkv_keep_indices", "stack", "to_mlx_cache", "tree", "trim", "update", "use_openblas",
    "window_attention_scores",
]  # fmt: skip


def test_the_public_api_is_the_stored_list():
    import kvfn

    assert sorted(kvfn.__all__) == API and len(set(kvfn.__all__)) == len(API)


def test_import_kvfn_lists_the_api_and_imports_no_models_package():
    r = run_python("""
        import sys, kvfn
        print(sorted(kvfn.__all__))
        assert all(hasattr(kvfn, n) for n in kvfn.__all__)
        # a name means one thing: no submodule shadows a function of the API
        import types
        modules = {"cache", "distributed", "partitioned", "ragged", "ring", "slots", "tree"}
        assert all(isinstance(getattr(kvfn, n), types.ModuleType) == (n in modules)
                   for n in kvfn.__all__), [n for n in kvfn.__all__ if n not in modules and
                                            isinstance(getattr(kvfn, n), types.ModuleType)]
        assert kvfn.evict is kvfn.cache.evict
        shadowed = [n for n in kvfn.__all__ if f"kvfn.{n}" in sys.modules and n not in modules]
        assert not shadowed, shadowed  # a function of the API hiding a submodule of its name
        assert not any(m == "models" or m.startswith(("models.", "kvfn_models", "kvfn_eval"))
                       for m in sys.modules), [m for m in sys.modules if "models" in m]
    """)
    assert r.returncode == 0, r.stderr
    for name in ("PositionPreservingKVCache", "SnapKV", "compact", "FunctionalModel",
                 "to_mlx_cache", "Policy", "parse_policy", "scored_prefill"):  # fmt: skip
        assert name in r.stdout


def test_importing_mlx_first_warns_once_about_openblas():
    r = run_python("""
        import warnings
        import mlx.core
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            import kvfn
            kvfn.use_openblas()
        from kvfn.blas import openblas_path
        print(len([x for x in w if "reference BLAS" in str(x.message)]), openblas_path() is not None)
    """)
    assert r.returncode == 0, r.stderr
    count, available = r.stdout.split()
    assert count == ("1" if available == "True" else "0")


def test_decoding_past_max_new_tokens_grows_and_matches_a_large_reservation():
    """Decode 2x past max_new_tokens; in a subprocess, so a crash fails this test only."""
    r = run_python("""
        import kvfn, mlx.core as mx
        from tests.tiny import tiny_model
        fm = kvfn.FunctionalModel(tiny_model("llama"))
        ids = list(range(3, 60))
        policy = kvfn.SnapKV(budget=16, window=4, sink_tokens=2)
        def run(max_new):
            states, _ = kvfn.compact(fm, ids, policy, max_new_tokens=max_new)
            token, out = mx.array([[ids[-1]]]), []
            for _ in range(600):
                logits, states = fm.decode(token, states)
                token = mx.argmax(logits, axis=-1)[:, None]
                out.append(token.item())
            return out, states
        small, s = run(10)
        large, t = run(700)
        assert small == large, (small, large)
        assert s[0].rows.item() == t[0].rows.item() == 616 and s[0].offset.item() == 656
        print("traces", fm.traces, "capacity", s[0].capacity)
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    _, traces, _, capacity = r.stdout.split()
    assert int(capacity) >= 616 and int(traces) <= 8  # grown in a few buckets, not per step


def test_update_past_capacity_raises_before_writing():
    s = kv.init(1, 2, 4, 3)
    s = kv.update(s, mx.ones((1, 2, 2, 4)), mx.ones((1, 2, 2, 4)))
    with pytest.raises(ValueError, match="cannot append 2 rows to a state holding up to 2 rows "
                                         "with capacity 3"):  # fmt: skip
        kv.update(s, mx.ones((1, 2, 2, 4)), mx.ones((1, 2, 2, 4)))
    with pytest.raises(ValueError, match="cannot append 2 rows"):  # the unchecked path too
        kv.append(s, mx.ones((1, 2, 2, 4)), mx.ones((1, 2, 2, 4)))
    with pytest.raises(AssertionError, match="shape"):  # only update checks shapes (chex)
        kv.update(s, mx.ones((1, 3, 1, 4)), mx.ones((1, 3, 1, 4)))
    row = mx.arange(8, dtype=mx.float32).reshape(1, 2, 1, 4)
    a, u = kv.append(s, row, -row), kv.update(s, row, -row)
    assert all(mx.array_equal(x, y).item() for x, y in zip(kv.arrays(a), kv.arrays(u)))
    assert (a.max_rows, a.dense, a.packed) == (u.max_rows, u.dense, u.packed) == (3, True, True)


def test_append_at_a_counted_row_count_is_the_traced_append():
    s = kv.update(kv.init(1, 2, 4, 6), mx.ones((1, 2, 3, 4)), mx.ones((1, 2, 3, 4)))
    packed = s.replace(dense=False)  # rows known to the caller, not to the state
    assert packed.static_rows is None and packed.packed
    row = mx.arange(16, dtype=mx.float32).reshape(1, 2, 2, 4)
    a, b = kv.append(packed, row, -row), kv.append(packed, row, -row, rows=3)
    assert all(mx.array_equal(x, y).item() for x, y in zip(kv.arrays(a), kv.arrays(b)))
    assert (b.max_rows, b.packed, int(b.rows.item())) == (a.max_rows, True, 5)
    with pytest.raises(ValueError, match="only for a packed state"):
        kv.append(packed.replace(packed=False), row, -row, rows=3)


def test_chunked_prefill_past_the_given_capacity_loses_no_token():
    fm = FunctionalModel(tiny_model("llama"))
    ids = mx.array([list(range(1, 90))])
    states = kvfn.prefill(fm, ids[:, :20], capacity=20, prefill_step_size=8)
    states = kvfn.prefill(fm, ids[:, 20:], states=states, prefill_step_size=8)
    whole = kvfn.prefill(fm, ids, prefill_step_size=8)
    assert states[0].rows.item() == whole[0].rows.item() == 89
    assert np.array_equal(np.array(states[0].positions)[..., :89],
                          np.array(whole[0].positions)[..., :89])  # fmt: skip
    assert mx.abs(states[0].keys[:, :, :89] - whole[0].keys[:, :, :89]).max().item() < 1e-5


@pytest.mark.parametrize(
    "keep, error, message",
    [
        (mx.array([[[0, 9]]]), ValueError, "keep_indices must lie in \\[0, 6\\).*from 0 to 9"),
        (mx.array([[[-1, 2]]]), ValueError, "keep_indices must lie in \\[0, 6\\).*from -1 to 2"),
        (mx.array([[[0.0, 2.0]]]), TypeError, "keep_indices must be integers, got dtype mlx.core.float32"),
        (mx.array([[[1, 1, 3]]]), ValueError, "must be sorted and unique.*repeated or decreasing"),
        (mx.array([[[3, 1]]]), ValueError, "must be sorted and unique"),
        (mx.zeros((1, 1, 0), mx.int32), ValueError, "keeps no row \\(k = 0\\)"),
        (mx.array([[0, 1]]), ValueError, "must have shape \\(batch, n_kv_heads, k\\) = \\(1, 1, k\\), got \\(1, 2\\)"),
        ([[[0, 1]]], TypeError, "keep_indices must be an mx.array, got list"),
    ],
)  # fmt: skip
def test_bad_keep_indices_are_named(keep, error, message):
    s = kv.from_full(mx.ones((1, 1, 6, 4)), mx.ones((1, 1, 6, 4)))
    with pytest.raises(error, match=message):
        kv.evict(s, keep)
    with pytest.raises(error, match=message):
        kvfn.evict_prompt_cache([s], [keep])


def test_bad_decode_inputs_are_named():
    fm = FunctionalModel(tiny_model("llama"))
    states, _ = kvfn.compact(fm, list(range(30)), SnapKV(budget=12, window=4), max_new_tokens=4)
    cases = [
        (mx.array([5]), ValueError, "tokens must have shape \\(batch, n >= 1\\), got \\(1,\\)"),
        (5, TypeError, "tokens must be an mx.array of shape \\(batch, n\\), got int"),
        (mx.array([[5], [6]]), ValueError, "tokens have batch 2 but the states hold 1"),
        (mx.array([[0.5]]), TypeError, "tokens must be integer ids, got dtype mlx.core.float32"),
        (mx.array([[1, 2]]), ValueError, "decode takes one token per sequence"),
    ]
    for tokens, error, message in cases:
        with pytest.raises(error, match=message):
            fm.decode(tokens, states)
    with pytest.raises(ValueError, match="2 states for a model of 3 layers"):
        fm.decode(mx.array([[5]]), states[:2])
    with pytest.raises(TypeError, match="state 0 is a list, not a kvfn state"):
        fm.decode(mx.array([[5]]), ([],) * 3)


def test_token_ids_and_states_that_do_not_fit_the_model_are_named():
    fm = FunctionalModel(tiny_model("llama"))  # vocabulary 97; 2 KV heads of dimension 16
    assert fm.vocab_size == 97
    empty = fm.init_states(1, 8)
    for ids in ([[10**6]], [[-1]], [[97]], [[3, 97]]):  # on the CPU, 10**6 used to crash
        with pytest.raises(ValueError, match=f"token id {max(ids[0], key=abs)} is outside"):
            fm.forward(mx.array(ids), empty)
    with pytest.raises(ValueError, match="token id 97 is outside the model's vocabulary"):
        fm.step(mx.array([[3, 97]]), empty)  # a prompt's chunk
    with pytest.raises(ValueError, match="token id 1000 is outside the model's vocabulary"):
        kvfn.compact(fm, [1000] * 40, SnapKV(budget=12, window=4))
    two = fm.init_states(2, 8)
    with pytest.raises(ValueError, match="state 1 holds batch 2, state 0 batch 1"):
        fm.forward(mx.array([[1]]), (empty[0], *two[1:]))
    wide = tuple(kv.init(1, 4, 16, 8) for _ in empty)
    with pytest.raises(ValueError, match="state 0 holds keys \\(1, 4, 8, 16\\) .* 2 KV heads"):
        fm.decode(mx.array([[1]]), wide)
    with pytest.raises(TypeError, match="a KV cache is floating point, got dtype mlx.core.int32"):
        fm.init_states(1, 8, mx.int32)
    with pytest.raises(ValueError, match="capacity must be >= 0, got -5"):
        kvfn.prefill(fm, mx.array([[1, 2]]), capacity=-5)


def test_unsupported_family_is_named():
    from mlx_lm.models import gpt2

    args = gpt2.ModelArgs(model_type="gpt2", n_ctx=64, n_embd=32, n_head=2, n_layer=1,
                          n_positions=64, layer_norm_epsilon=1e-5, vocab_size=50)  # fmt: skip
    with pytest.raises(
        TypeError, match="kvfn cannot thread .*gpt2.*no attention module|applies no rope"
    ):
        FunctionalModel(gpt2.Model(args))


def test_mixtral_attention_names_are_understood():
    from mlx_lm.models import mixtral

    args = mixtral.ModelArgs(model_type="mixtral", vocab_size=50, hidden_size=32,
                             intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_experts_per_tok=2, num_key_value_heads=2, num_local_experts=2)  # fmt: skip
    model = mixtral.Model(args)
    fm = FunctionalModel(model)
    assert fm.n_heads == [4, 4] and fm.n_kv_heads == [2, 2]
    states, _ = kvfn.compact(fm, list(range(40)), StreamingLLM(budget=12), max_new_tokens=2)
    logits, _ = fm.decode(mx.array([[3]]), states)
    assert logits.shape == (1, 50)


def test_a_weight_changed_after_tracing_is_seen_by_decode():
    model = tiny_model("llama")
    fm = FunctionalModel(model)
    states = kvfn.prefill(fm, mx.array([list(range(10))]), capacity=16)
    token = mx.array([[3]])
    before, _ = fm.decode(token, states)
    traces = fm.traces
    model.update({"model": {"norm": {"weight": model.model.norm.weight * 0 + 2.0}}})
    after, _ = fm.decode(token, states)
    eager, _ = fm.forward(token, states)
    assert fm.traces == traces  # the same compiled step, new weights
    assert mx.abs(after - before).max().item() > 1e-3
    assert mx.abs(after - eager[:, -1]).max().item() < 1e-5


def test_wrapping_leaves_the_model_alone_and_wrappers_apart():
    model = tiny_model("qwen3")
    attn = [layer.self_attn for layer in model.layers]
    ropes = [a.rope for a in attn]
    a, b = FunctionalModel(model), FunctionalModel(model)
    assert [layer.self_attn for layer in model.layers] == attn  # the same objects
    assert all(a_.rope is r for a_, r in zip(attn, ropes))
    ids = mx.array([list(range(20))])
    sa, scores = kvfn.scored_prefill(a, ids, window=4)
    sb = kvfn.prefill(b, ids)
    plain = model(ids)  # the caller's model still runs as mlx-lm's, no kvfn hook in it
    la, _ = a.forward(mx.array([[5]]), sa)
    lb, _ = b.forward(mx.array([[5]]), sb)
    assert mx.abs(la - lb).max().item() < 1e-5 and plain.shape == (1, 20, 97)
    assert all(float(s.sum().item()) > 0 for s in scores)


def test_compact_does_not_sync_with_the_host(monkeypatch):
    """Between the prefill chunks and the first decode: no .item()/.tolist()/int()/bool() on
    an array, and no mx.eval of the last chunk or of the eviction (only of earlier chunks)."""
    fm = FunctionalModel(tiny_model("llama"))
    ids = list(range(1, 50))
    kvfn.compact(fm, ids, SnapKV(budget=16, window=4), max_new_tokens=4, prefill_step_size=16)
    evals = []
    real_eval = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: evals.append(1) or real_eval(*a))

    def forbidden(*_args, **_kwargs):
        raise AssertionError("host sync inside compact")

    for name in ("item", "tolist", "__int__", "__bool__", "__float__", "__index__"):
        monkeypatch.setattr(mx.array, name, forbidden)
    states, result = kvfn.compact(fm, ids, SnapKV(budget=16, window=4), max_new_tokens=4,
                                  prefill_step_size=16)  # fmt: skip
    monkeypatch.undo()
    assert len(evals) == 2  # 48 context tokens in chunks of 16: only the first two evaluated
    assert result.rows_after == (16, 16, 16)
    out, _ = greedy_tokens(fm, mx.array([[ids[-1]]]), states, 3)
    assert len(out) == 3


def test_short_reprs():
    s = kv.init(1, 3, 64, 4096)
    assert repr(s) == ("PositionPreservingKVCache(batch=1, kv_heads=3, head_dim=64, capacity=4096, "
                       "max_rows=0, dtype=mlx.core.float32, dense)")  # fmt: skip
    fm = FunctionalModel(tiny_model("llama"))
    _, result = kvfn.compact(fm, list(range(40)), SnapKV(budget=12, window=4), max_new_tokens=1)
    assert repr(result).startswith("EvictionResult(layers=3, rows 117 -> 36, bytes ")
    assert len(repr(result)) < 120


def test_the_library_has_no_import_cycle():
    """No kvfn module imports, at any depth of its relative imports (a function's too), one that
    imports it back."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "kvfn"

    def name(path: Path) -> str:
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {name(p): p for p in root.rglob("*.py")}
    graph = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                subs = {f"{target}.{a.name}" for a in node.names} & modules.keys()
                deps |= subs or ({target} & modules.keys())
        graph[module] = deps - {module}

    def reaches(start: str, goal: str, seen: set) -> bool:
        for d in graph[start]:
            if d == goal or (d not in seen and (seen.add(d) or reaches(d, goal, seen))):
                return True
        return False

    cyclic = sorted(m for m in graph if reaches(m, m, set()))
    assert len(graph) > 20 and not cyclic, cyclic
