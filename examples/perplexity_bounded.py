"""Reading a long text through a capped cache (StreamingLLM's measurement): the perplexity of each
next token when the model reads the text one token at a time and its cache holds at most R rows a
layer, against the full cache: mlx-lm's ``RotatingKVCache(max_size=R, keep=4)`` and kvfn caches
that evict every ``interval`` tokens back to R - interval rows (``kvfn.to_mlx_cache(states,
policy=...)``: SnapKV scored by the last window's queries, the model as ``attending_copy``; and
StreamingLLM's rows), one process, the embedded model by default.

python examples/perplexity_bounded.py                       # docs/*.md as the text, 2,048 tokens
python examples/perplexity_bounded.py --text-file book.txt --tokens 8192 --rows 1024 --interval 256
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvfn  # isort: skip  (puts OpenBLAS in front before mlx loads)
import kvfn_models  # noqa: E402
import mlx.core as mx  # noqa: E402
from benchmark_generation import check_cap  # noqa: E402
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache  # noqa: E402

from kvfn.wrapper import attending_copy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("full cache", "mlx-lm rotating", "kvfn streaming", "kvfn snapkv")


def nll(model, tokens: list[int], caches) -> tuple[list[float], int]:
    """Each next token's negative log-likelihood, reading ``tokens`` one at a time, and the most
    rows a layer held."""
    out, most = [], 0
    for i in range(len(tokens) - 1):
        logits = model(mx.array([[tokens[i]]]), cache=caches)[0, -1].astype(mx.float32)
        out.append(mx.logsumexp(logits) - logits[tokens[i + 1]])
        most = max(most, caches[0].size())  # a count on the host
        if i % 64 == 63:
            mx.eval(out)
    return [float(x) for x in out], most


def caches_of(config: str, model, fm, args):
    if config == "full cache":
        return make_prompt_cache(model)
    if config == "mlx-lm rotating":
        return [RotatingKVCache(max_size=args.rows, keep=4) for _ in model.layers]
    budget = args.rows - args.interval
    policy = (kvfn.StreamingLLM(budget=budget) if config == "kvfn streaming"
              else kvfn.SnapKV(budget=budget, window=args.window))  # fmt: skip
    return kvfn.to_mlx_cache(fm.init_states(1, 0), policy=policy, interval=args.interval)


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="a local mlx-lm model folder (default: the embedded SmolLM2)")
    p.add_argument("--text-file", help="the text to read (default: docs/*.md, concatenated)")
    p.add_argument("--tokens", type=int, default=2048, help="the text's first N tokens")
    p.add_argument("--rows", type=int, default=512, help="the cap: max_size, budget + interval")
    p.add_argument("--interval", type=int, default=128, help="kvfn's: tokens between compactions")
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--configs", default=",".join(CONFIGS))
    args = p.parse_args(argv)
    configs = check_cap(p, args, CONFIGS)
    if args.tokens <= args.rows:
        p.error(f"--tokens must be above --rows {args.rows}, got {args.tokens}")
    model, tokenizer = kvfn_models.load(args.model) if args.model else kvfn_models.load()
    files = [Path(args.text_file)] if args.text_file else sorted((ROOT / "docs").glob("*.md"))
    tokens = tokenizer.encode("\n\n".join(f.read_text() for f in files))[: args.tokens]
    if len(tokens) < args.tokens:
        p.error(f"--tokens {args.tokens}: the text has {len(tokens)}")
    fm, attending = kvfn.FunctionalModel(model), attending_copy(model)
    out, full = [], None
    for c in configs:
        tic = time.perf_counter()
        runner = attending if c == "kvfn snapkv" else model
        losses, most = nll(runner, tokens, caches_of(c, model, fm, args))
        full = losses if c == "full cache" else full
        past = losses[args.rows :]  # the tokens read after the cap was first reached
        row = {"config": c, "ppl": math.exp(sum(losses) / len(losses)),
               "ppl_past_cap": math.exp(sum(past) / len(past)), "most_rows": most,
               "seconds": time.perf_counter() - tic}  # fmt: skip
        if full is not None and c != "full cache":
            row["agree_with_full"] = sum(abs(a - b) < 1e-3 for a, b in zip(losses, full)) / len(
                full
            )
        print(json.dumps(row), flush=True)
        out.append(row)
    print(f"\n{len(tokens)} tokens of {args.text_file or 'docs/*.md'}, read one at a time; cap "
          f"{args.rows} rows (kvfn: budget {args.rows - args.interval} + interval "
          f"{args.interval})")  # fmt: skip
    print(f"{'config':<18}{'perplexity':>11}{'past the cap':>14}{'most rows':>10}")
    for r in out:
        print(f"{r['config']:<18}{r['ppl']:>11.3f}{r['ppl_past_cap']:>14.3f}{r['most_rows']:>10}")
    return out


if __name__ == "__main__":
    main()
