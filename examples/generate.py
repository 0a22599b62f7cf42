"""Long-prompt generation with opt-in KV-cache eviction, on the embedded SmolLM2 (or any model
kvfn_models.load takes).

python examples/generate.py --kv-eviction snapkv --compare   # evicted beside the full cache
python examples/generate.py --prompt-file doc.txt --kv-eviction streaming --kv-budget 256
cat doc.txt | python examples/generate.py --prompt-file -     # no eviction: plain mlx-lm

Tensor parallel over 2 local processes (ring backend; only rank 0 prints, KV bytes are per rank;
give the venv's python by its own path, not a resolved symlink):
.venv/bin/mlx.launch --backend ring -n 2 .venv/bin/python examples/generate.py --kv-eviction snapkv
"""

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvfn  # isort: skip  (puts OpenBLAS in front before mlx loads)
import kvfn_models  # noqa: E402
import mlx.core as mx  # noqa: E402
from mlx_lm.generate import stream_generate  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402

from kvfn.blas import loaded_openblas  # noqa: E402
from kvfn.serving import flags  # noqa: E402
from kvfn.serving.flags import (  # noqa: E402
    non_negative_float,
    non_negative_int,
    positive_int,
    probability,
    seed,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="a .gguf file or mlx-lm folder (default: embedded SmolLM2)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", help="read the prompt from a file ('-' for stdin)")
    p.add_argument(
        "--context-tokens",
        type=positive_int,
        default=1000,
        help="size of the built-in document when no prompt is given (default 1000)",
    )
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    p.add_argument("--max-tokens", type=positive_int, default=100)
    p.add_argument("--temp", type=non_negative_float, default=0.0)
    p.add_argument("--top-p", type=probability, default=0.0)
    p.add_argument("--top-k", type=non_negative_int, default=0)
    p.add_argument("--min-p", type=probability, default=0.0)
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--prefill-step-size", type=positive_int, default=512)
    p.add_argument("--quiet", action="store_true", help="print only the report, not the text")
    flags.add_arguments(
        p,
        "none, or a policy name: chunkkv (the default of `make demo`: the prompt ends with its "
        "question), adakvzip-global, snapkv, streaming, ... (README: Policies)",
    )
    p.add_argument(
        "--compare", action="store_true", help="also generate with the full cache, side by side"
    )
    args = p.parse_args(argv)
    flags.read(args, p)  # --kv-max-rows and --kv-decode-interval checked there, with the policy
    if args.policy is None and args.compare:
        p.error("argument --compare: needs --kv-eviction POLICY")
    args.progress = progress
    return args


def builtin_document(tokenizer, n_tokens: int) -> str:
    """English reference text from the standard library, cut to about n_tokens tokens."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in ("for", "while", "if", "try", "with", "compound"))
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < n_tokens:
        ids = ids + ids
    return tokenizer.decode(ids[:n_tokens])


def read_prompt(args, tokenizer) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file == "-":
        return sys.stdin.read()
    if args.prompt_file is not None:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise SystemExit(f"error: --prompt-file {args.prompt_file!r}: no such file")
        return path.read_text()
    doc = builtin_document(tokenizer, args.context_tokens)
    return f"{doc}\n\nIn two sentences, what does the text above explain?"


def encode(tokenizer, text: str, raw: bool) -> list[int]:
    if raw or not tokenizer.has_chat_template:
        return tokenizer.encode(text)
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )


def check_prompt(tokens: list[int], args) -> None:
    """Eviction compacts all but the last token, so it needs two; mlx-lm needs one."""
    need = 1 if args.policy is None else 2
    if len(tokens) < need:
        what = "generating" if args.policy is None else f"--kv-eviction {args.kv_eviction}"
        raise SystemExit(f"error: prompt tokens: {len(tokens)}; {what} needs at least {need}")


def progress(done: int, total: int) -> None:
    print(f"\rprefill {done}/{total} tokens", end="", file=sys.stderr, flush=True)


def compact(fm, tokens: list[int], args) -> tuple:
    """Compact all but the last prompt token with the policy; mlx-lm decodes from the last one."""
    start = time.perf_counter()
    try:
        # evicting while generating, the states need room for one interval, not every token
        room = args.max_tokens if args.kv_decode_interval is None else args.kv_decode_interval
        states, result = kvfn.compact(fm, tokens, args.policy, max_new_tokens=room,
                                      prefill_step_size=args.prefill_step_size,
                                      progress=args.progress, max_rows=args.kv_max_rows,
                                      probe=args.kv_probe)  # fmt: skip
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    mx.eval(kvfn.tree.arrays(states))
    seconds = time.perf_counter() - start
    report = {
        "prefill_tokens_per_s": round((len(tokens) - 1) / seconds, 1),
        "kv_rows_kept": f"{result.total_rows_after} / {result.total_rows_before}",
        "kv_bytes": f"{result.total_bytes_before / 1e6:.1f} MB -> {result.total_bytes_after / 1e6:.1f} MB",
    }
    if result.peak_rows is not None:
        report["kv_peak_rows"] = result.peak_rows
    return states, report


def kvfn_stream(fm, tokenizer, states, token: int, args, sampler):
    """Decode with kvfn's compiled step (for states mlx-lm cannot hold: per-head groups),
    pipelined as mlx-lm's generate_step is: step t+1 is queued before token t is read. Only
    the token is queued; the state arrays the next step reads are computed as its inputs
    (queuing the state too would hold its buffers until the step completes, so the next step's
    writes would copy them)."""

    def step(y, states):
        logits, states = fm.decode(y, states)
        y = sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))[:, None]
        mx.async_eval(y)
        return y, states

    def tokens(states):
        y, states = step(mx.array([[token]]), states)
        for n in range(1, args.max_tokens + 1):
            next_y = None
            if n < args.max_tokens:  # no step whose token would never be read
                next_y, states = step(y, states)
            yield y
            y = next_y

    return pieces(tokenizer, tokens(states))


def bounded_stream(fm, tokenizer, states, token: int, args, sampler):
    """Decode with ``kvfn.bounded_decode``: the states compacted back to the budget every
    ``--kv-decode-interval`` tokens; the most rows held is reported. Its checks run here, when
    it is called, so a refusal is an error line, not a traceback from inside the stream."""

    def sample(logits):
        return sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))[:, None]

    try:
        steps = kvfn.bounded_decode(fm, mx.array([[token]]), states, args.policy,
                                    steps=args.max_tokens, interval=args.kv_decode_interval,
                                    sample=sample)  # fmt: skip
    except ValueError as e:
        raise SystemExit(f"error: --kv-decode-interval: {e}")
    held = args.policy.budget + args.kv_decode_interval
    return pieces(tokenizer, steps, {"kv_decode_rows_held_at_most": held})


def pieces(tokenizer, tokens, extra=None):
    """Text pieces of queued tokens (B, 1) read one at a time, up to an end token; the last
    item carries the counts (and ``extra``)."""
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    start, n = time.perf_counter(), 0
    for n, y in enumerate(tokens, 1):
        t = y.item()
        if t in tokenizer.eos_token_ids:
            break
        detokenizer.add_token(t)
        yield detokenizer.last_segment, None
    detokenizer.finalize()
    seconds = time.perf_counter() - start
    yield detokenizer.last_segment, {"generated_tokens": n,
                                     "decode_tokens_per_s": round(n / seconds, 1), **(extra or {})}  # fmt: skip


def mlx_lm_stream(model, tokenizer, prompt, args, sampler, **extra):
    last = None
    for last in stream_generate(model, tokenizer, prompt, max_tokens=args.max_tokens,
                                sampler=sampler, prefill_step_size=args.prefill_step_size,
                                prompt_progress_callback=args.progress, **extra):  # fmt: skip
        yield last.text, None
    yield "", {"generated_tokens": last.generation_tokens,
               "decode_tokens_per_s": round(last.generation_tps, 1),
               "prefill_tokens_per_s": round(last.prompt_tps, 1)}  # fmt: skip


def layouts(states) -> set:
    """The layouts among ``states``: "slots" (``kvfn.slots``), "parts" (KV heads in parts),
    "plain" (one state for every head)."""
    kinds = {kvfn.HeadSlotsKVCache: "slots", kvfn.HeadPartitionedKVCache: "parts"}
    return {kinds.get(type(s), "plain") for s in states}


def generate(model, tokenizer, tokens, args, sampler, fm=None) -> dict:
    """One generation (evicting when ``fm`` is given); prints the text unless --quiet."""
    mx.random.seed(args.seed)
    mx.reset_peak_memory()
    text, eviction = "", {}
    if fm is None:
        stream = mlx_lm_stream(model, tokenizer, tokens, args, sampler)
    else:
        states, eviction = compact(fm, tokens, args)
        if args.kv_decode_interval is not None:
            eviction["decoder"] = "kvfn (bounded_decode)"
            stream = bounded_stream(fm, tokenizer, states, tokens[-1], args, sampler)
        elif all(isinstance(s, kvfn.PositionPreservingKVCache) for s in states):
            caches = kvfn.to_mlx_cache(states)  # mlx-lm decodes over the compacted rows
            stream = mlx_lm_stream(model, tokenizer, mx.array(tokens[-1:]), args, sampler,
                                   prompt_cache=caches)  # fmt: skip
        else:  # per-head groups; each two-group layer in one buffer (faster, the same logits)
            states = kvfn.slots.pack_layers(states)
            mx.eval(kvfn.tree.arrays(states))  # the packing's copy, not in the first step
            eviction["decoder"] = "kvfn (" + ", ".join(sorted(layouts(states))) + ")"
            stream = kvfn_stream(fm, tokenizer, states, tokens[-1], args, sampler)
    for piece, stats in stream:
        if not args.quiet and piece:
            if not text:
                print(file=sys.stderr)
            print(piece, end="", flush=True)
        text += piece
    prefill = eviction.pop("prefill_tokens_per_s", None) or stats.pop("prefill_tokens_per_s")
    stats.pop("prefill_tokens_per_s", None)
    return {
        "prompt_tokens": len(tokens),
        "prefill_tokens_per_s": prefill,
        **stats,
        "peak_memory_gb": round(mx.get_peak_memory() / 1e9, 3),
        **eviction,
        "text": text,
    }


def tensor_parallel(model, args):
    """Under mlx.launch (every rank runs this script): shard the model over the ranks and
    silence all but rank 0. None in a single process."""
    group = mx.distributed.init()
    if group.size() == 1:
        return None
    heads = kvfn.distributed.shard(model, group)
    if group.rank() != 0:
        args.quiet, args.progress = True, None
        sys.stdout = open(os.devnull, "w")
    what = (
        "heads and MLPs sharded" if heads else "MLPs sharded, attention whole (heads do not split)"
    )
    return f"{group.size()} ranks, {what}; KV bytes are per rank"


def main(argv=None) -> dict:
    args = parse_args(argv)
    try:
        model, tokenizer = kvfn_models.load(args.model)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: --model: {e}")
    if args.policy is not None:  # KVzip: the tokenizer's repeat instruction
        args.policy = args.policy.for_tokenizer(tokenizer)
    parallel = tensor_parallel(model, args)
    tokens = encode(tokenizer, read_prompt(args, tokenizer), args.no_chat_template)
    check_prompt(tokens, args)
    sampler = make_sampler(args.temp, args.top_p, args.min_p, top_k=args.top_k)
    fm = kvfn.FunctionalModel(model) if args.policy is not None else None
    runs = {}
    if args.compare:
        if not args.quiet:
            print("--- full cache ---", file=sys.stderr)
        runs["full cache"] = generate(model, tokenizer, tokens, args, sampler)
        if not args.quiet:
            print(f"\n--- {args.kv_eviction} ---", file=sys.stderr)
    report = generate(model, tokenizer, tokens, args, sampler, fm)
    report["blas"] = loaded_openblas() or "bundled"
    if parallel:
        report["tensor_parallel"] = parallel
    if args.compare:
        full = runs["full cache"]
        report["full_cache"] = {k: v for k, v in full.items()}
        report["same_text_as_full_cache"] = full["text"] == report["text"]
    print()
    for k, v in report.items():
        if k == "full_cache":
            print("full cache: " + ", ".join(f"{a}={b}" for a, b in v.items() if a != "text"))
            if args.quiet:
                print(f"full cache text: {v['text']!r}")
        elif k != "text":
            print(f"{k}: {v}")
    if args.quiet and args.compare:
        print(f"{args.kv_eviction} text: {report['text']!r}")
    return report


if __name__ == "__main__":
    main()
