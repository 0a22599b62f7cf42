"""Bounded memory's answers: the same needle questions through mlx-lm's full cache, mlx-lm's
rotating cache (``RotatingKVCache(max_size=R, keep=4)``, what ``--max-kv-size`` gives: it evicts
as it prefills), a kvfn policy after the prefill and the same policy evicting while it prefills
(``kvfn.compact(max_rows=R)``), all holding R rows a head after the prompt, in one process.

python examples/quality_bounded.py                          # embedded SmolLM2, CPU
python examples/quality_bounded.py --model M.gguf --lengths 4096 8192 --rows 512 --samples 20
python examples/quality_bounded.py --policy snapkv                        # any that recompacts
python examples/quality_bounded.py --model DIR --grid --lengths 16384 --ratios 0.125 0.25 \\
    --modes aware agnostic --policy snapkv --prefill-step-size 2048 --out q.json

Modes (as the evaluation grid's, docs/evaluation.md):
* aware: the prompt is the whole question (context, then the question at its end), as a user
  sends it: the bounded prefill evicts the context's chunks before the question arrives, scored
  by each chunk's own last queries; its last chunk (the question) scores the final compaction.
* agnostic: the context alone is compacted (bounded or not; scored by its own last window),
  then the question is prefilled onto the compacted states and answered (mlx-lm: the same cache
  objects fed the context, then the question).

Budgets: ``--rows R`` (rows a head after the prompt), or ``--ratios`` (each a fraction of the
prompt's tokens: R = max(window + 4, round(ratio * P)), P the whole prompt in aware mode, the
context in agnostic mode, as the grid counts them). ``--grid``: the grid's four tasks.

Intervals: 95% percentile bootstraps over samples (``kvfn_eval.report``, the grid's), the mean
over tasks resampling each task's samples on its own; the paired differences (bounded minus the
same policy after the prefill; bounded minus mlx-lm's rotating cache) likewise, per sample.
Samples go seed by seed, every task at each seed, so a run cut short leaves the tasks even;
``--out`` is rewritten after every question (every answer and the table); ``--merge`` prints
the table of several such files (processes that shared out the samples) with one set of
intervals. A question that runs the device out of memory (processes sharing a GPU) is asked
once more, then skipped in every config and listed under ``skipped`` in ``--out``.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvfn  # isort: skip  (puts OpenBLAS in front before mlx loads)
import kvfn_models  # noqa: E402
import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache  # noqa: E402

from kvfn_eval import answers, report, tasks  # noqa: E402
from kvfn_eval.evaluator import ANSWER_TOKENS, decode, prompt_tokens, token_counter  # noqa: E402

MLX_LM = ("mlx-lm full", "mlx-lm rotating")
MODES = ("aware", "agnostic")
GRID_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking")
SINKS = 4  # the rotating cache's keep; a ratio's rows are never below these and the window
RETRY_SECONDS = 10  # before asking again a question that ran out of device memory


def configs(policy: str) -> tuple:
    return (*MLX_LM, f"kvfn {policy}", f"kvfn {policy} bounded")


def mlx_lm_answer(model, context, question, n: int, rows, step: int, eos: set) -> list:
    """Greedy answer over mlx-lm's caches: ``context`` fed first in chunks of ``step`` (none in
    aware mode: the whole prompt is ``question``), then ``question`` by ``generate_step``."""
    if rows is None:
        cache = make_prompt_cache(model)
    else:  # made directly: make_prompt_cache ignores max_kv_size for a model with make_cache
        cache = [RotatingKVCache(max_size=rows, keep=SINKS) for _ in model.layers]
    for i in range(0, len(context), step):
        model(mx.array([context[i : i + step]]), cache=cache)
        mx.eval([c.state for c in cache])
    out = []
    for t, _ in generate_step(mx.array(question), model, prompt_cache=cache, max_tokens=n,
                              prefill_step_size=step):  # fmt: skip
        if int(t) in eos:
            break
        out.append(int(t))
    return out


def kvfn_answer(fm, context, question, n: int, policy, step: int, cap: Optional[int], eos: set,
                probe: bool = False):  # fmt: skip
    """Greedy answer and the most rows held: ``kvfn.compact`` over ``context`` (aware: the
    whole prompt, ``question`` empty), evicting while prefilling at ``cap`` rows (None: after
    the prefill; ``probe``: its compactions scored by the context's last window), then the
    question's tokens run over the compacted states (the evaluator's
    agnostic mode) and the answer decoded by kvfn's steps."""
    ids = context if not question else context + question
    rest = [context[-1]] + list(question)  # compact prefills all but the context's last token
    states, result = kvfn.compact(fm, context, policy, max_new_tokens=len(rest) + n,
                                  prefill_step_size=step,
                                  max_rows=cap, probe=probe)  # fmt: skip

    def first():
        logits, after = fm.forward(mx.array([rest]), states)
        return logits[:, -1], after

    (out,) = decode(fm, first, n, eos)
    peak = getattr(result, "peak_rows", None)
    return out, int(peak) if peak is not None else len(ids) - 1


def budget_rows(budget, prompt_rows: int, window: int) -> int:
    """A budget in rows: itself, or a fraction (< 1) of the prompt's rows (the grid's)."""
    if budget >= 1:
        return int(budget)
    return max(window + SINKS, round(budget * prompt_rows))


def records_of(rows: list) -> list:
    """The answers as ``kvfn_eval.report`` records: one a (question, mode, budget, config); the
    full cache's once a (question, mode), with budget None."""
    out = []
    for r in rows:
        for c, score in r["scores"].items():
            if c == "mlx-lm full" and r["budget_index"] > 0:
                continue
            out.append(dict(mode=r["mode"], target_tokens=r["target_tokens"], task=r["task"],
                            seed=r["seed"], method=c,
                            budget=None if c == "mlx-lm full" else r["budget"],
                            rows=r["rows"], score=score,
                            kv_fraction=1.0 if c == "mlx-lm full" else r["rows"] / r["held"],
                            needle_kept=None))  # fmt: skip
    return out


def summary(rows: list, names: tuple) -> tuple:
    """The table: per (mode, length, budget, config) the mean over tasks (percent) with its
    interval, the questions and samples, the mean rows; the bounded config's paired differences
    from the same policy after the prefill and from mlx-lm's rotating cache (points). And the
    per-task summary rows."""
    recs = records_of(rows)
    if not recs:
        return [], []
    summ = report.summarize(recs)
    diffs = report.differences(recs, references=(names[2], names[1]))
    bounded = {(d["mode"], d["target_tokens"], d["budget"], d["reference"]): d for d in diffs
               if d["task"] == "average" and d["method"] == names[3]}  # fmt: skip
    table = []
    for s in summ:
        if s["task"] != "average":
            continue
        key = (s["mode"], s["target_tokens"], s["budget"])
        rs = [r["rows"] for r in rows if (r["mode"], r["target_tokens"], r["budget"]) == key]
        entry = dict(mode=s["mode"], target_tokens=s["target_tokens"], budget=s["budget"],
                     config=s["method"], score=s["score"], lo=s["lo"], hi=s["hi"],
                     questions=s["n"], samples=s["samples"],
                     rows=None if s["budget"] is None else sum(rs) / len(rs))  # fmt: skip
        if s["method"] == names[3]:
            for ref, name in ((names[2], "vs_after_prefill"), (names[1], "vs_rotating")):
                d = bounded.get((*key, ref))
                entry[name] = d and dict(difference=d["difference"], lo=d["lo"], hi=d["hi"],
                                         samples=d["samples"])  # fmt: skip
        table.append(entry)
    return table, [s for s in summ if s["task"] != "average"]


def _interval(value, lo, hi, sign="") -> str:
    if value is None:
        return ""
    text = f"{value:{sign}.1f}"
    return text if lo is None else f"{text} [{lo:{sign}.1f}, {hi:{sign}.1f}]"


def write(path, args, rows, names, seconds, skipped=()) -> tuple:
    table, by_task = summary(rows, names)
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(dict(args=vars(args), seconds=round(seconds, 1), table=table,
                           by_task=by_task, rows=rows, skipped=list(skipped)), f)  # fmt: skip
        os.replace(tmp, path)
    return table, by_task


def print_table(table: list) -> None:
    for t in table:
        line = (f"{t['mode']:<9}{t['target_tokens']:>7} {str(t['budget']):>6} "
                f"{t['config']:<24}{_interval(t['score'], t['lo'], t['hi']):>22} "
                f"n={t['questions']}")  # fmt: skip
        for name in ("vs_after_prefill", "vs_rotating"):
            d = t.get(name)
            if d:
                line += f"  {name} {_interval(d['difference'], d['lo'], d['hi'], '+')}"
        print(line)


def question_key(d: dict) -> tuple:
    """A question asked in one mode (a row's or a skipped question's)."""
    return d["task"], d["target_tokens"], d["seed"], d["mode"]


def print_skipped(skipped: list) -> None:
    if skipped:
        print(f"{len(skipped)} questions skipped, out of device memory twice: {skipped}")


def merged(paths: list) -> dict:
    """The table of several runs' ``--out`` files (processes that shared the questions out by
    length, mode and seed), with intervals over all their samples; a question answered twice (a
    mode, budget and sample in two files) counts once. One policy, cap factor and probe
    throughout."""
    runs = [json.loads(Path(f).read_text()) for f in paths]
    for setting, before in (("policy", None), ("cap_factor", 1.0), ("probe", False)):
        values = {r["args"].get(setting, before) for r in runs}  # files before the flag
        if len(values) != 1:
            raise SystemExit(f"--merge: the files ran different {setting}s: {sorted(values)}")
    rows = {}
    for run in runs:
        for r in run["rows"]:
            rows.setdefault((*question_key(r), r["budget_index"]), r)
    table, by_task = summary(list(rows.values()), configs(runs[0]["args"]["policy"]))
    seconds = sum(r["seconds"] for r in runs)
    print(f"{len(rows)} (question, mode, budget) rows from {len(runs)} files, {seconds:.0f} s "
          "of processes. Score % [95% bootstrap interval]; bounded minus after the prefill, "
          "and minus mlx-lm rotating, in points:")  # fmt: skip
    print_table(table)
    answered = {question_key(r) for r in rows.values()}
    skipped = {}
    for run in runs:  # once each, and not where another file answered it
        for q in run.get("skipped", []):
            if question_key(q) not in answered:
                skipped.setdefault(question_key(q), q)
    skipped = list(skipped.values())
    print_skipped(skipped)
    return {"table": table, "by_task": by_task, "rows": list(rows.values()), "skipped": skipped}


def answer_question(fm, tokenizer, args, budgets, prompt, question, asked: dict, eos) -> list:
    """One question in one mode through every config at every budget: a row a budget."""
    model, mode, step = fm.model, asked["mode"], args.prefill_step_size
    names, n, t0 = configs(args.policy), ANSWER_TOKENS[asked["task"]], time.perf_counter()
    if mode == "aware":  # the whole prompt at once
        context, ask = prompt.head + prompt.tail, []
    else:
        context, ask = prompt.head, prompt.tail
    held = len(context)  # the rows a budget's ratio counts
    full = mlx_lm_answer(model, [] if not ask else context, ask or context, n, None, step, eos)
    rows = []
    for b, budget in enumerate(budgets):
        R = budget_rows(budget, held, args.window)
        pol = kvfn.parse_policy(args.policy, budget=R, window=args.window)
        pol = pol.for_tokenizer(tokenizer)  # KVzip: the repeat instruction
        got = {names[0]: (full, None)}
        rotating = mlx_lm_answer(model, [] if not ask else context, ask or context, n, R, step,
                                 eos)  # fmt: skip
        got[names[1]] = (rotating, None)
        cap = round(args.cap_factor * R)  # >= R: the factor is checked
        got[names[2]] = kvfn_answer(fm, context, ask, n, pol, step, None, eos)
        got[names[3]] = kvfn_answer(fm, context, ask, n, pol, step, cap, eos, args.probe)
        row = dict(asked, length=len(prompt.head) + len(prompt.tail), budget=budget,
                   budget_index=b, rows=R, held=held, peak_rows=got[names[3]][1], answers={},
                   scores={})  # fmt: skip
        for c in names:
            row["answers"][c] = tokenizer.decode(got[c][0])
            row["scores"][c] = answers.match_all(row["answers"][c], question.answers)
        row["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def retried(ask, asked: dict, skipped: list, late=lambda: False) -> list:
    """``ask()``'s rows. Processes sharing a GPU can run it out of memory for a moment: such a
    question is asked once more after ``RETRY_SECONDS`` (unless ``late()``), then recorded in
    ``skipped``."""
    for attempt in range(2):
        try:
            return ask()
        except RuntimeError as e:
            if "out of memory" not in str(e):
                raise
            error = str(e)
        mx.clear_cache()  # out of the except block: the failed attempt's arrays are gone
        again = attempt == 0 and not late()
        print(f"{asked}: {error}; " + ("asking again" if again else "skipped"), flush=True)
        if not again:
            skipped.append({**asked, "error": error})
            return []
        time.sleep(RETRY_SECONDS)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--merge", nargs="+", metavar="FILE",
                   help="print the table of these --out files together, and run nothing")
    p.add_argument("--model", help="a .gguf file or mlx-lm folder (default: embedded SmolLM2)")
    p.add_argument("--tasks", nargs="+", choices=sorted(tasks.TASKS),
                   help="default: niah_single passkey niah_multikey (--grid: the grid's)")
    p.add_argument("--grid", action="store_true", help=f"the grid's tasks: {' '.join(GRID_TASKS)}")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024], help="prompt tokens")
    p.add_argument("--modes", nargs="+", default=["aware"], choices=MODES)
    p.add_argument(
        "--policy",
        default="chunkkv",
        help="a kvfn policy that evicts while "
        "prefilling (chunkkv: the README's choice for a prompt ending in its question)",
    )
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--rows", type=int, nargs="+", help="rows a head after the prompt (128)")
    budget.add_argument("--ratios", type=float, nargs="+",
                        help="rows as fractions of the prompt (< 1), as the grid")  # fmt: skip
    p.add_argument("--samples", type=int, default=4, help="per task and length")
    p.add_argument("--first-sample", type=int, default=0, help="the first sample's seed")
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--cap-factor", type=float, default=1.0,
                   help="kvfn's cap while prefilling as a multiple of the rows (1: the budget); "
                   "above 1 the last compaction (in aware mode, scored by the question's "
                   "window) chooses the rows from more")  # fmt: skip
    p.add_argument("--probe", action="store_true",
                   help="kvfn bounded: each compaction while prefilling scored by the prompt's "
                   "last window (kvfn.compact(probe=True)), not by the chunk's last queries")
    p.add_argument("--prefill-step-size", type=int, default=256)
    p.add_argument("--deadline", type=float, help="seconds after which no question starts")
    p.add_argument("--out", help="a JSON file: every answer and the table, after each question")
    p.add_argument("--cache-limit-gb", type=float,
                   help="MLX's buffer cache limit, for processes sharing a GPU (the grid's: 2)")
    args = p.parse_args(argv)
    if args.merge:
        return merged(args.merge)
    if args.tasks is None:
        args.tasks = list(GRID_TASKS if args.grid else ("niah_single", "passkey", "niah_multikey"))
    budgets = args.ratios if args.ratios else (args.rows or [128])
    if args.ratios and not all(0 < r < 1 for r in args.ratios):
        p.error("--ratios: each a fraction in (0, 1)")
    if args.rows and min(args.rows) < args.window + SINKS:
        p.error(f"need --rows >= --window + {SINKS}")
    if not args.cap_factor >= 1:
        p.error(f"--cap-factor must be >= 1 (the cap is at least the budget), got {args.cap_factor}")
    if args.samples < 1:
        p.error("need --samples >= 1")
    try:
        policy = kvfn.parse_policy(args.policy, budget=max(args.window + SINKS, 64),
                                   window=args.window)  # fmt: skip
        if policy.cannot_recompact:
            raise ValueError(f"{args.policy} cannot evict while prefilling: "
                             f"{policy.cannot_recompact}")  # fmt: skip
    except ValueError as e:
        p.error(str(e))
    names = configs(args.policy)
    if args.cache_limit_gb is not None:
        mx.set_cache_limit(int(args.cache_limit_gb * 2**30))
    tic = time.perf_counter()
    model, tokenizer = kvfn_models.load(args.model)
    fm = kvfn.FunctionalModel(model)
    eos = set(tokenizer.eos_token_ids) | {tokenizer.eos_token_id}
    count = token_counter(tokenizer)
    step = args.prefill_step_size
    rows: list = []
    skipped: list = []  # questions that ran out of device memory twice

    def late() -> bool:
        return bool(args.deadline) and time.perf_counter() - tic > args.deadline

    print(f"loaded in {time.perf_counter() - tic:.1f} s", flush=True)
    for L in args.lengths:
        for seed in range(args.first_sample, args.first_sample + args.samples):
            for task in args.tasks:
                if late():
                    break
                sample = tasks.generate(task, seed=seed, target_tokens=L, count_tokens=count,
                                        n_questions=1)  # fmt: skip
                question = sample.questions[0]
                prompt = prompt_tokens(tokenizer, sample, question)
                for mode in args.modes:
                    asked = dict(task=task, target_tokens=L, seed=seed, mode=mode)
                    rows += retried(lambda: answer_question(fm, tokenizer, args, budgets, prompt,
                                                            question, asked, eos),
                                    asked, skipped, late)  # fmt: skip
                    write(args.out, args, rows, names, time.perf_counter() - tic, skipped)
    table, _ = write(args.out, args, rows, names, time.perf_counter() - tic, skipped)
    samples = len({(r["task"], r["target_tokens"], r["seed"]) for r in rows})
    print(f"\n{samples} samples ({', '.join(args.tasks)}) at {args.lengths} tokens, modes "
          f"{args.modes}, budgets {budgets}, {args.policy}, prefill chunks of {step}; "
          f"{time.perf_counter() - tic:.0f} s. Score % [95% bootstrap interval]; bounded minus "
          f"after the prefill, and minus mlx-lm rotating, in points:")  # fmt: skip
    print_table(table)
    print_skipped(skipped)
    return {"table": table, "rows": rows, "skipped": skipped}


if __name__ == "__main__":
    main()
