"""Bounded memory's answers: the same needle questions through mlx-lm's full cache, mlx-lm's
rotating cache (``RotatingKVCache(max_size=R, keep=4)``, what ``--max-kv-size`` gives: it evicts
as it prefills), a kvfn policy after the prefill and the same policy evicting while it prefills
(``kvfn.compact(max_rows=R)``), all holding R rows a head after the prompt, in one process.

python examples/quality_bounded.py                          # embedded SmolLM2, CPU
python examples/quality_bounded.py --model M.gguf --lengths 4096 8192 --rows 512 --samples 20
python examples/quality_bounded.py --policy snapkv                        # any that recompacts

Each prompt is the whole question (context, then the question at its end), as a user sends it:
the bounded prefill evicts the context's chunks before the question arrives, scored by each
chunk's own last queries; its last chunk (the question) scores the final compaction.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvfn  # isort: skip  (puts OpenBLAS in front before mlx loads)
import kvfn_models  # noqa: E402
import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache  # noqa: E402

from kvfn_eval import answers, tasks  # noqa: E402
from kvfn_eval.evaluator import ANSWER_TOKENS, prompt_tokens, token_counter  # noqa: E402

MLX_LM = ("mlx-lm full", "mlx-lm rotating")


def configs(policy: str) -> tuple:
    return (*MLX_LM, f"kvfn {policy}", f"kvfn {policy} bounded")


def mlx_lm_answer(model, ids, n: int, rows, step: int) -> list:
    if rows is None:
        cache = make_prompt_cache(model)
    else:  # made directly: make_prompt_cache ignores max_kv_size for a model with make_cache
        cache = [RotatingKVCache(max_size=rows, keep=4) for _ in model.layers]
    steps = generate_step(mx.array(ids), model, prompt_cache=cache, max_tokens=n,
                          prefill_step_size=step)  # fmt: skip
    return [int(t) for t, _ in steps]


def kvfn_answer(fm, ids, n: int, policy, step: int, bounded: bool) -> list:
    rows = policy.budget
    states, _ = kvfn.compact(fm, ids, policy, max_new_tokens=n, prefill_step_size=step,
                             max_rows=rows if bounded else None)  # fmt: skip
    out, token = [], mx.array([[ids[-1]]])
    for _ in range(n):
        logits, states = fm.decode(token, states)
        token = mx.argmax(logits, axis=-1)[:, None]
        out.append(int(token.item()))
    return out


def answer(config: str, model, fm, ids, n: int, args) -> list:
    if config == "mlx-lm full":
        return mlx_lm_answer(model, ids, n, None, args.prefill_step_size)
    if config == "mlx-lm rotating":
        return mlx_lm_answer(model, ids, n, args.rows, args.prefill_step_size)
    policy = kvfn.parse_policy(args.policy, budget=args.rows, window=args.window)
    return kvfn_answer(fm, ids, n, policy, args.prefill_step_size, config.endswith("bounded"))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="a .gguf file or mlx-lm folder (default: embedded SmolLM2)")
    p.add_argument("--tasks", nargs="+", default=["niah_single", "passkey", "niah_multikey"],
                   choices=sorted(tasks.TASKS))  # fmt: skip
    p.add_argument("--lengths", type=int, nargs="+", default=[1024], help="prompt tokens")
    p.add_argument(
        "--policy",
        default="chunkkv",
        help="a kvfn policy that evicts while "
        "prefilling (chunkkv: the README's choice for a prompt ending in its question)",
    )
    p.add_argument("--rows", type=int, default=128, help="rows a head after the prompt")
    p.add_argument("--samples", type=int, default=4, help="per task and length")
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--prefill-step-size", type=int, default=256)
    args = p.parse_args(argv)
    if args.rows < args.window + 4 or args.samples < 1:
        p.error("need --rows >= --window + 4 and --samples >= 1")
    try:
        policy = kvfn.parse_policy(args.policy, budget=args.rows, window=args.window)
        if policy.cannot_recompact:
            raise ValueError(f"{args.policy} cannot evict while prefilling: "
                             f"{policy.cannot_recompact}")  # fmt: skip
    except ValueError as e:
        p.error(str(e))
    names = configs(args.policy)
    model, tokenizer = kvfn_models.load(args.model)
    fm = kvfn.FunctionalModel(model)
    eos = set(tokenizer.eos_token_ids) | {tokenizer.eos_token_id}
    count = token_counter(tokenizer)
    scores, rows = {c: [] for c in names}, []
    tic = time.perf_counter()
    for L in args.lengths:
        for task in args.tasks:
            for seed in range(args.samples):
                sample = tasks.generate(task, seed=seed, target_tokens=L, count_tokens=count,
                                        n_questions=1)  # fmt: skip
                question = sample.questions[0]
                prompt = prompt_tokens(tokenizer, sample, question)
                ids = prompt.head + prompt.tail
                row = {"task": task, "length": len(ids), "seed": seed, "scores": {},
                       "answers": {}}  # fmt: skip
                for c in names:
                    out = answer(c, model, fm, ids, ANSWER_TOKENS[task], args)
                    out = out[: next((i for i, t in enumerate(out) if t in eos), len(out))]
                    row["answers"][c] = tokenizer.decode(out)
                    row["scores"][c] = answers.match_all(row["answers"][c], question.answers)
                    scores[c].append(row["scores"][c])
                rows.append(row)
                print(json.dumps(row), flush=True)
    n = len(scores[names[0]])
    print(f"\n{n} questions ({', '.join(args.tasks)}) at {args.lengths} tokens, {args.rows} rows "
          f"a head after the prompt, prefill chunks of {args.prefill_step_size}; "
          f"{time.perf_counter() - tic:.0f} s")  # fmt: skip
    table = []
    for c in names:
        mean = float(np.mean(scores[c]))
        print(f"{c:<22}{mean:>8.3f}")
        table.append({"config": c, "score": round(mean, 4), "questions": n})
    return {"table": table, "rows": rows}


if __name__ == "__main__":
    main()
