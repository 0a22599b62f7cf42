import mlx.core as mx

import kvfn
from examples import profile_peak
from kvfn.states.layout import bucket


def test_the_parts_of_each_peak_are_measured_and_sum_to_it(capsys):
    limit = mx.set_cache_limit(0)
    mx.set_cache_limit(limit)
    argv = ["--shape", "tiny", "--prompt-tokens", "512", "--rows", "64", "--window", "8",
            "--prefill-step-size", "64", "--warmup", "0"]  # fmt: skip
    out = profile_peak.main(argv)
    assert [r["config"] for r in out] == list(profile_peak.bm.CONFIGS)
    shape = profile_peak.SHAPES["tiny"][1]
    layers, heads, dim = (shape[k] for k in ("num_hidden_layers", "num_key_value_heads",
                                             "head_dim"))  # fmt: skip
    row = layers * heads * dim * 4 * 2  # float32 keys and values, every layer
    by = {r["config"]: r for r in out}
    for r in out:
        assert "error" not in r, r
        parts = r["parts"]
        assert set(parts) == set(profile_peak.PARTS)
        assert all(v >= 0 for k, v in parts.items() if k != "remainder"), parts
        assert sum(parts.values()) == r["peak"] > 0
        assert parts["kv"] == r["kv"] > 0  # the caches' own bytes at the peak chunk
        # the peak, above the weights, is no less than what the caches held in it
        assert r["peak"] >= parts["kv"] and r["peak_cache_limit_0"] > 0
    # the KV part is the cache bytes of the config's own objects: mlx-lm's KVCache grows 256
    # rows at a time (generate_step may have queued the next token's step, and its growth,
    # when the bytes are read), kvfn's states after the prefill are made once, a bucket of the
    # context
    full = by["mlx-lm full"]
    rows = full["rows_before"] + full["tokens"]
    assert full["kv"] % (256 * row) == 0 and rows * row <= full["kv"] <= (rows + 256) * row
    fm = kvfn.FunctionalModel(profile_peak.random_model("tiny", mx.float32))
    made = profile_peak.state_bytes(fm.init_states(1, bucket(511)))  # the 511-token context
    # (after a forward the layers share one offset array, counted once)
    assert made - 4 * layers <= by["kvfn snapkv"]["kv"] <= made
    # the bounded configs hold a few hundred rows at their peaks, never the whole prompt
    for c in ("mlx-lm rotating", "kvfn snapkv bounded"):
        assert by[c]["kv"] < full["kv"] and by[c]["peak"] < full["peak"]
    assert "forward transient growing with rows held" in capsys.readouterr().out
    assert mx.set_cache_limit(limit) == limit  # the script gave the limit back
    assert kvfn.compact.__name__ == "compact"  # and its hooks

