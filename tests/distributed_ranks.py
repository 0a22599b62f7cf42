"""The ranks of tests/test_distributed.py. Under ``mlx.launch -n 2`` each rank shards a model
(``kvfn.distributed.shard``), compacts with every policy, decodes, and saves what it kept to
``OUT/<case>-rank<r>.npz``; the test computes the single-process reference with ``run``.

    mlx.launch --backend ring -n 2 .venv/bin/python tests/distributed_ranks.py OUT
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import kvfn  # isort: skip  (OpenBLAS before mlx)
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

STEPS = 6
# policies whose row sets span a layer's heads: a rank alone would choose differently
SHARED = ("snapkv-layer", "chunkkv")


def tiny_policies() -> dict:
    settings = dict(budget=48, window=8, sink_tokens=4)
    return {
        "snapkv-head": kvfn.SnapKV(**settings),
        "snapkv-layer": kvfn.SnapKV(**settings, per_head=False),
        "chunkkv": kvfn.ChunkKV(**settings, chunk_size=8),
        "random": kvfn.RandomRows(**settings, seed=3),
        "streaming": kvfn.StreamingLLM(budget=48, sink_tokens=4),
    }


def smollm2_policies() -> dict:
    settings = dict(budget=64, window=16, sink_tokens=4)
    return {
        "snapkv-head": kvfn.SnapKV(**settings),
        "snapkv-layer": kvfn.SnapKV(**settings, per_head=False),
    }


# tiny families with Model.shard (tests/tiny.py: 4 query / 2 KV heads)
TINY = ("llama", "qwen2", "qwen3")


def tiny_case(family: str = "llama"):
    from tiny import tiny_model

    prompt = mx.random.randint(0, 97, (160,), key=mx.random.key(7)).tolist()
    # random weights fall into a one-token loop under greedy decoding: feed a fixed
    # continuation instead, so every step sees a new token
    forced = mx.random.randint(0, 97, (STEPS,), key=mx.random.key(8)).tolist()
    return tiny_model(family), prompt, tiny_policies(), forced


def smollm2_prompt_text() -> str:
    return (
        "The lighthouse keeper logged the ships that passed each night. On Monday the Aurora "
        "went north with timber; on Tuesday the Bell came south with salt and the Corsair "
        "anchored off the point until dawn. "
    ) * 4 + "Which ship anchored off the point?"


def smollm2_prompt(tokenizer) -> list:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": smollm2_prompt_text()}], add_generation_prompt=True
    )


def smollm2_case(model=None, tokenizer=None):
    if model is None:
        import kvfn_models

        model, tokenizer = kvfn_models.load()
    return model, smollm2_prompt(tokenizer), smollm2_policies(), None


def kept_positions(states, result) -> np.ndarray:
    """(layers, B, heads, rows kept) true positions of the kept rows."""
    return np.stack([np.array(s.positions[..., :k]) for s, k in zip(states, result.rows_after)])


def decode(fm, states, first: int, forced) -> tuple[list, np.ndarray]:
    """Compiled decode of STEPS tokens: greedy, or fed ``forced``; (argmax tokens, logits)."""
    token, tokens, logits = mx.array([[first]]), [], []
    for i in range(STEPS):
        out, states = fm.decode(token, states)
        best = mx.argmax(out, axis=-1, keepdims=True)
        tokens.append(best.item())
        logits.append(np.array(out[0]))
        token = best if forced is None else mx.array([[forced[i]]])
    return tokens, np.stack(logits)


def alone(fm, prompt, policy) -> np.ndarray:
    """Kept positions if this rank selected from its own heads' scores only (no group)."""
    context = mx.array([prompt[:-1]])
    window = policy.observation_window(context.shape[1])
    states, scores = kvfn.scored_prefill(fm, context, window=window)
    states, result = kvfn.compact_states(states, scores, policy)
    return kept_positions(states, result)


def run(fm, prompt, policies, forced, controls=()) -> dict:
    """Per policy: kept positions, decode tokens and logits, KV bytes before and after."""
    out = {}
    for name, policy in policies.items():
        states, result = kvfn.compact(fm, prompt, policy, max_new_tokens=STEPS)
        out[f"{name}/positions"] = kept_positions(states, result)
        out[f"{name}/bytes_before"] = result.total_bytes_before
        out[f"{name}/bytes_after"] = result.total_bytes_after
        out[f"{name}/tokens"], out[f"{name}/logits"] = decode(fm, states, prompt[-1], forced)
        if name in controls:
            out[f"{name}/alone"] = alone(fm, prompt, policy)
    return out


def uneven_error(group) -> str:
    """What FunctionalModel says of mlx-lm's own shard of 3 KV heads over 2 ranks."""
    from mlx_lm.models import llama
    from tiny import COMMON, FAMILIES

    heads = dict(num_attention_heads=6, num_key_value_heads=3, head_dim=16)
    args = llama.ModelArgs.from_dict(
        dict(model_type="llama", **COMMON, **{**FAMILIES["llama"], **heads})
    )
    model = llama.Model(args)
    model.shard(group)
    try:
        kvfn.FunctionalModel(model)
    except ValueError as e:
        return str(e)
    return ""


def main(out_dir: str) -> None:
    group = mx.distributed.init()
    out, rank = Path(out_dir), group.rank()
    (out / f"started-rank{rank}.json").write_text(json.dumps({"size": group.size()}))
    if group.size() == 1:
        return
    cases = [(f"tiny-{f}", lambda f=f: tiny_case(f)) for f in TINY]
    for case, build in (*cases, ("smollm2", smollm2_case)):
        model, prompt, policies, forced = build()
        sharded = kvfn.distributed.shard(model, group)
        fm = kvfn.FunctionalModel(model)
        result = run(fm, prompt, policies, forced, controls=SHARED if sharded else ())
        result["heads_sharded"] = sharded
        result["group_found"] = fm.group is not None
        np.savez(out / f"{case}-rank{rank}.npz", **result)
    (out / f"uneven-rank{rank}.txt").write_text(uneven_error(group))


if __name__ == "__main__":
    main(sys.argv[1])
