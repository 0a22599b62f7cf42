"""Accuracy vs KV memory of eviction methods on RULER-style tasks, both query modes.

    python examples/evaluate.py --lengths 2048 4096 --budgets 256 512 1024 --samples 4 --out runs/eval

Per sample the context is prefilled once; every method and question reuses that state. Methods:
full; any policy name kvfn.parse_policy takes (snapkv, snapkv-k15-avg-layer, streaming, random,
...: evict to a budget of rows; duo-r25 with --head-pattern: DuoAttention, 25% retrieval heads);
kvB (mlx-lm KV quantization to B bits, every row kept); POLICY+kvB (evict, then quantize, keeping
as many rows as fit in the budget's bytes). Writes OUT.json (records + summary; rewritten after
every sample; OUT.json.gz with --gzip), OUT.md (tables) and OUT-MODE-LENGTH.png. --merge a.json
b.json.gz makes them from earlier runs' records.
Each mean comes with its 95% bootstrap interval over samples, every policy with its paired
difference from snapkv and from streaming at the same budget, and each (mode, length, budget)
with the policy that answers most and its paired lead over the second (kvfn_eval.report).
"""

import argparse
import dataclasses
import gzip
import json
import os
import subprocess
import sys
import time
import zlib
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if __name__ == "__main__":  # a run, a lone process or a worker; not an importer's process
    # The CUDA decode kernel's split count, a template parameter, follows the row count
    # (kernels.plan): every new row count can compile a new variant, in every process. Answers,
    # not speed, are measured here, so decode takes MLX's own attention unless the caller sets
    # KVFN_DECODE_KERNEL (read when kvfn is imported).
    os.environ.setdefault("KVFN_DECODE_KERNEL", "0")

import kvfn  # isort: skip  (puts OpenBLAS in front before mlx loads)
import kvfn_models  # noqa: E402
import mlx.core as mx  # noqa: E402

from kvfn_eval import report, tasks  # noqa: E402
from kvfn_eval.evaluator import (  # noqa: E402
    MODES,
    Evaluator,
    Method,
    token_counter,
)
from kvfn_eval.memory import peak_gib, reset_peak  # noqa: E402

DEFAULT_METHODS = ["full", "snapkv", "streaming", "random", "kv8", "kv4", "snapkv+kv8",
                   "snapkv+kv4"]  # fmt: skip


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="a .gguf file or mlx-lm folder (default: embedded SmolLM2)")
    p.add_argument("--tasks", nargs="+", default=list(tasks.TASKS), metavar="TASK",
                   help=f"from: {', '.join(tasks.TASKS)}")  # fmt: skip
    p.add_argument("--lengths", type=int, nargs="+", default=[1024], help="prompt tokens")
    p.add_argument("--budgets", type=float, nargs="+", default=[128, 256, 512],
                   help="KV rows, or below 1 a fraction of each prompt's rows (0.25)")  # fmt: skip
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--samples", type=int, default=2, help="samples per task and length")
    p.add_argument("--first-sample", type=int, default=0,
                   help="the index of the first sample (more samples of an earlier run)")  # fmt: skip
    p.add_argument("--fill", type=int, metavar="N",
                   help="run a (length, task) cell's samples (of --first-sample's --samples) only "
                   "until it has N, counting the samples the --have results hold (theirs are "
                   "not run again)")  # fmt: skip
    p.add_argument("--have", nargs="+", default=[], metavar="JSON",
                   help="earlier results (.json or .json.gz) that --fill counts")  # fmt: skip
    p.add_argument("--questions", type=int, default=4, help="questions per multi-key sample")
    p.add_argument("--ask", type=int, help="questions asked of each sample (default: all); "
                   "the other keys stay as distractors (RULER's multi-key asks one)")  # fmt: skip
    p.add_argument("--answer-tokens", type=int, metavar="N",
                   help="the most tokens an answer takes (default: its task's own; fewer makes "
                   "a quicker run whose scores are not the grid's)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window", type=int, default=32, help="SnapKV observation window")
    p.add_argument("--sink-tokens", type=int, default=4)
    p.add_argument("--prefill-step-size", type=int, default=512)
    p.add_argument("--head-pattern", help="a DuoAttention pattern folder or .tsv, for duo "
                   "methods (duo-r25: 25%% of KV heads retrieve; make one with `kvfn heads`)")  # fmt: skip
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                   help="cast the model's floating-point weights (and so its KV cache)")  # fmt: skip
    p.add_argument("--out", default="eval", help="output path prefix (default: ./eval)")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="run nothing: tables and plots from the records of earlier runs "
                   "(.json or .json.gz)")  # fmt: skip
    p.add_argument("--gzip", action="store_true",
                   help="write OUT.json.gz, not OUT.json (results to commit: a tenth the size)")  # fmt: skip
    p.add_argument("--batch", type=int, default=8,
                   help="decode up to this many questions at once, a sample's calls together "
                   "(a question asked of a cell's compacted states; states of similar rows "
                   "together, each padded to the batch's longest)")  # fmt: skip
    p.add_argument("--workers", type=int, default=1,
                   help="processes sharing the device, each a share of the samples")  # fmt: skip
    p.add_argument("--no-warm-up", action="store_true",
                   help="with --workers: start every worker at once, with no warm-up process "
                   "first (where the device's kernel caches are already warm: a later run on "
                   "the same machine)")  # fmt: skip
    p.add_argument("--shard", help=argparse.SUPPRESS)  # K/N: a worker's share
    p.add_argument("--deadline", type=float,
                   help="seconds after main() starts (the model load and --workers' warm-up "
                   "included; Python's imports, a second or two, not) past which no new sample "
                   "or worker starts (the rest left out; a started sample ends)")  # fmt: skip
    # a worker's: the parent's end time, epoch seconds (time.time())
    p.add_argument("--stop-at", type=float, help=argparse.SUPPRESS)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    for t in args.tasks:
        if t not in tasks.TASKS:
            p.error(f"argument --tasks: unknown task {t!r} (choose from {', '.join(tasks.TASKS)})")
    try:
        args.methods = [Method.parse(m) for m in args.methods]
    except ValueError as e:
        p.error(f"argument --methods: {e}")
    if min(args.lengths) < 128:
        p.error(f"argument --lengths: must be >= 128 tokens, got {min(args.lengths)}")
    for b in args.budgets:
        if b <= 0 or (b >= 1 and b != int(b)):
            p.error(f"argument --budgets: a budget is a fraction in (0, 1) or a whole number "
                    f"of rows, got {b:g}")  # fmt: skip
    args.budgets = [int(b) if b >= 1 else b for b in args.budgets]
    rows = [b for b in args.budgets if b >= 1]
    if rows and min(rows) < args.window + args.sink_tokens:
        p.error(f"argument --budgets: must be >= window + sink tokens = "
                f"{args.window + args.sink_tokens}, got {min(rows)}")  # fmt: skip
    if args.ask is not None and args.ask < 1:
        p.error(f"argument --ask: must be >= 1, got {args.ask}")
    if args.first_sample < 0:
        p.error(f"argument --first-sample: must be >= 0, got {args.first_sample}")
    if args.deadline is not None and not args.deadline > 0:
        p.error(f"argument --deadline: must be > 0 seconds, got {args.deadline:g}")
    for name in ("samples", "questions", "batch", "workers", "fill", "answer_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"argument --{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.have and args.fill is None:
        p.error("argument --have: counts samples for --fill N; give --fill")
    out = result_path(args.out, args.gzip).resolve()
    if any(Path(h).resolve() == out for h in args.have):
        p.error(f"argument --have: {out} is also this run's output (--out): it would be replaced")
    try:
        args.had = have_samples(args.have) if not args.merge else set()
    except ValueError as e:
        p.error(f"argument --have: {e}")
    return args


LEGEND = (
    "First, per mode, length and budget, the policy whose task average answers most, with its "
    "paired lead in points over the second (over the samples both answered). Then accuracy % "
    "[95% bootstrap interval over samples, none with one sample] (KV bytes, % of the full "
    "cache), after each row's samples (an average's: its tasks' together); then each policy's "
    "paired difference in points from snapkv and from streaming at the same budget.\n"
)


def save(path: Path, config: dict, records: list, errors: list = ()) -> dict:
    """Records, summary, paired differences and leaders as JSON (gzipped when ``path`` ends in
    .gz)."""
    summary = report.summarize(records)
    result = dict(config=config, records=records, summary=summary,
                  differences=report.differences(records),
                  leaders=report.leaders(records, summary), errors=list(errors))  # fmt: skip
    path.write_bytes(encode(path, json.dumps(result, indent=1)))
    return result


def encode(path: Path, text: str) -> bytes:
    """``text``'s bytes for ``path``: gzipped if its name ends in .gz."""
    return gzip.compress(text.encode(), mtime=0) if path.suffix == ".gz" else text.encode()


def load(path: Path) -> dict:
    """A result written by ``save`` (or a part by ``write_partial``): a dict with records."""
    try:
        data = path.read_bytes()
        result = json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)
    except (OSError, EOFError, zlib.error, ValueError) as e:
        raise ValueError(f"{str(path)!r} is not a readable result ({e})") from None
    if not isinstance(result, dict) or not isinstance(result.get("records"), list):
        raise ValueError(f"{str(path)!r} is not a result: no list of records")
    return result


def result_path(prefix: str, gzipped: bool) -> Path:
    """Where a run's JSON goes: PREFIX.json, or PREFIX.json.gz."""
    return Path(f"{prefix}.json" + (".gz" if gzipped else ""))


def config_of(args) -> dict:
    config = {k: v for k, v in vars(args).items() if k not in ("methods", "had")}
    config.update(methods=[m.name for m in args.methods], device=str(mx.default_device()),
                  card=mx.device_info().get("device_name"),  # results of two cards told apart
                  decode_kernel=kvfn.kernels.ENABLED and kvfn.kernels.on_cuda())  # fmt: skip
    return config


def jobs(args) -> list[tuple]:
    """(sample index, length, task) in the order run: every length and task has its i-th
    sample before any has its (i+1)-th, so a deadline leaves the cells evenly sampled. With
    ``--workers``, a warm-up process first runs the first job alone (so that the device's
    kernels are compiled once, into MLX's and CUDA's disk caches, not by every worker at once;
    one job: the scoring kernels' templates do not depend on its length; none with
    ``--no-warm-up``); worker ``--shard K/N`` then takes every N-th other job from the K-th."""
    first = args.first_sample
    order = [(i, n, t) for i in range(first, first + args.samples) for n in args.lengths
             for t in args.tasks]  # fmt: skip
    if args.fill is not None:
        order = fill(order, args.fill, args.had, args.seed)
    warm = [] if args.no_warm_up else order[:1]
    if args.shard == "warm":
        return warm
    if args.shard:
        k, n = (int(x) for x in args.shard.split("/"))
        return [j for j in order if j not in warm][k::n]
    return order


def sample_seed(seed: int, i: int) -> int:
    """The i-th sample's seed under ``--seed``."""
    return seed * 10_000 + i


def have_samples(paths: list) -> set:
    """The samples, (seed, length, task), that earlier results hold."""
    got = set()
    for path in paths:
        for r in load(Path(path))["records"]:
            if r.get("seed") is None:
                raise ValueError(f"{path!r} has records without a seed: they match no sample")
            got.add((r["seed"], r["target_tokens"], r["task"]))
    return got


def fill(order: list, n: int, have: set, seed: int) -> list:
    """The jobs of ``order`` that bring each (length, task) cell to ``n`` samples, those in
    ``have`` counted (and not run again), in ``order``'s order."""
    held = Counter((length, task) for _, length, task in have)
    need = {(length, task): n - held[length, task] for _, length, task in order}
    out = []
    for i, length, task in order:
        if need[length, task] > 0 and (sample_seed(seed, i), length, task) not in have:
            out.append((i, length, task))
            need[length, task] -= 1
    return out


def past_deadline(args) -> bool:
    """Whether --deadline has passed: no sample or worker starts after it."""
    return args.stop_at is not None and time.time() > args.stop_at


def write_partial(path: Path, config: dict, records: list, errors: list) -> None:
    """The records so far, replaced whole (a process killed mid-write leaves the last)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(encode(path, json.dumps(dict(config=config, records=records, errors=errors))))
    tmp.replace(path)


def run(args) -> dict:
    # a grid call's processes share the device (a lone one beside workers too): none keeps
    # more than 2 GiB of freed buffers for itself
    mx.set_cache_limit(2 << 30)
    model, tokenizer = kvfn_models.load(args.model)
    if args.dtype:
        model.set_dtype(getattr(mx, args.dtype))
    pattern = kvfn.HeadPattern.load(args.head_pattern) if args.head_pattern else None
    ev = Evaluator(model, tokenizer, window=args.window, sink_tokens=args.sink_tokens,
                   prefill_step_size=args.prefill_step_size, seed=args.seed,
                   head_pattern=pattern, batch=args.batch)  # fmt: skip
    count = token_counter(tokenizer)
    records, errors = [], []
    # progress stamps count from where --deadline counts (a worker: from its parent's start)
    t0 = time.time() if None in (args.stop_at, args.deadline) else args.stop_at - args.deadline
    path, config = result_path(args.out, args.gzip), config_of(args)
    for i, length, task in jobs(args):
        if past_deadline(args):
            print(f"deadline: stopped before {length} {task} #{i}", flush=True)
            break
        started = time.perf_counter()
        sample = tasks.generate(task, seed=sample_seed(args.seed, i), target_tokens=length,
                                count_tokens=count, n_questions=args.questions)  # fmt: skip
        if args.ask is not None:  # the other keys stay in the context as distractors
            sample = dataclasses.replace(sample, questions=sample.questions[: args.ask])
        reset_peak()
        try:
            out = ev.run(sample, args.methods, args.budgets, args.modes, args.answer_tokens)
        except Exception as e:
            if not args.shard:
                raise
            # a worker stops (after a device error every later step fails too); the error
            # travels with its records
            errors.append(dict(task=task, length=length, sample=i, error=repr(e)))
            write_partial(path, config, records, errors)
            print(f"error at {length} {task} #{i}, worker stops: {e!r}", flush=True)
            break
        peak = peak_gib()  # what a worker needs: --workers sizes by it
        seconds = round(time.perf_counter() - started, 2)  # its making too; sharing with --workers
        records += [dict(r, peak_gib=round(peak, 2), sample_seconds=seconds) for r in out]
        write_partial(path, config, records, errors)
        if not args.quiet:
            done = {m.name: [] for m in args.methods}
            for r in out:
                done[r["method"]].append(r["score"])
            line = " ".join(f"{k}={100 * sum(v) / len(v):.0f}" for k, v in done.items())
            print(f"[{time.time() - t0:7.1f}s{' ' + args.shard if args.shard else ''}] "
                  f"{length} {task} #{i} (peak {peak:.1f} GiB): {line}", flush=True)  # fmt: skip
    if args.shard:
        return dict(config=config, records=records, errors=errors)
    return save(path, config, records, errors)


def run_workers(args, argv: list) -> dict:
    """A warm-up process, then ``--workers N`` processes, each a shard of the jobs; their
    records merged."""
    env = dict(os.environ)
    env.setdefault("CUDA_CACHE_MAXSIZE", str(4 << 30))  # the driver's PTX -> SASS cache

    def part(shard: str) -> str:
        return f"{args.out}.part-{shard.replace('/', '-')}"

    def start(shard: str):
        cmd = [sys.executable, __file__, *argv, "--workers", "1", "--shard", shard,
               "--out", part(shard)]  # fmt: skip
        if args.stop_at is not None:  # one deadline for all, from the parent's start
            cmd += ["--stop-at", repr(args.stop_at)]
        return shard, subprocess.Popen(cmd, env=env)

    done = []  # none started past --deadline: each would load the model only to stop
    if not (past_deadline(args) or args.no_warm_up):
        done.append(start("warm"))
        done[0][1].wait()
    if past_deadline(args):
        print("deadline: passed before the workers started", flush=True)
    else:
        done += [start(f"{k}/{args.workers}") for k in range(args.workers)]
    records, errors, parts = [], [], []
    for shard, proc in done:
        code = proc.wait()
        path = result_path(part(shard), args.gzip)
        if code != 0:
            errors.append(dict(shard=shard, exit_code=code))
        if path.is_file():
            got = load(path)
            records += got["records"]
            errors += got["errors"]
            parts.append(path)
    result = save(result_path(args.out, args.gzip), config_of(args), records, errors)
    for path in parts:  # only once merged: a run killed while waiting keeps every part
        path.unlink()
    return result


# one answer: a sample (task, length, seed), a cell and a question
ANSWER_KEY = ("task", "target_tokens", "seed", "mode", "method", "budget", "question")


def answer_lengths(config: dict) -> set:
    """The --answer-tokens of a run's config, or of every run a merged one holds."""
    if "configs" in config:
        return set().union(*(answer_lengths(c) for c in config["configs"]))
    return {config.get("answer_tokens")}


def merge(args) -> dict:
    runs = []
    for path in args.merge:
        try:
            runs.append(load(Path(path)))
        except ValueError as e:
            raise SystemExit(f"error: --merge {e}")
    lengths = [answer_lengths(r["config"]) for r in runs]
    if len(set().union(*lengths)) > 1:  # scores of shorter answers are not the grid's
        said = ", ".join(f"{p!r}: {sorted(n, key=str)}" for p, n in zip(args.merge, lengths))
        raise SystemExit(f"error: --merge: runs of different --answer-tokens ({said})")
    records = [r for run_ in runs for r in run_["records"]]
    seen: dict = {}
    for path, run_ in zip(args.merge, runs):
        for r in run_["records"]:
            key = tuple(r.get(k) for k in ANSWER_KEY)
            if r.get("seed") is not None and key in seen:
                raise SystemExit(f"error: --merge: {path!r} and {seen[key]!r} both answer "
                                 f"{dict(zip(ANSWER_KEY, key))}")  # fmt: skip
            seen[key] = path
    errors = [e for run_ in runs for e in run_.get("errors", [])]
    args.tasks = sorted({r["task"] for r in records}, key=list(tasks.TASKS).index)
    config = dict(merged=args.merge, configs=[r["config"] for r in runs])
    return save(result_path(args.out, args.gzip), config, records, errors)


def main(argv=None) -> dict:
    started = time.time()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    if args.stop_at is None and args.deadline is not None:
        args.stop_at = started + args.deadline
    out = Path(args.out)
    if args.fill is not None and not (args.merge or args.shard) and not jobs(args):
        raise SystemExit(f"error: nothing to run: every (length, task) cell has {args.fill} "
                         f"samples in --have")  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        if args.merge:
            result = merge(args)
        elif args.workers > 1:
            result = run_workers(args, argv)
        else:
            result = run(args)
        if args.shard:
            return result
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}")
    tables = [report.markdown(result["summary"])]
    diffs = [report.markdown_differences(result["differences"])]
    for t in args.tasks:
        tables.append(report.markdown(result["summary"], task=t))
        diffs.append(report.markdown_differences(result["differences"], task=t))
    pngs = report.plot(result["summary"], str(out))
    images = [f"![{Path(png).stem}]({Path(png).name})" for png in pngs]  # beside the tables
    leaders = report.markdown_leaders(result["leaders"])
    Path(f"{out}.md").write_text("\n".join([LEGEND, leaders, *tables, *diffs, "\n".join(images)]))
    print(tables[0])
    print(f"wrote {result_path(args.out, args.gzip)}, {out}.md, {', '.join(pngs)}")
    return result


if __name__ == "__main__":
    main()
