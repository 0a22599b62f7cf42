"""Evaluation records to summaries, markdown tables and plots (pure, except ``plot`` writes).

A record is one answer: a dict with at least ``mode``, ``target_tokens``, ``task``, ``method``,
``budget`` (None for methods that keep every row), ``score``, ``kv_fraction`` (KV bytes over
the full cache's) and ``needle_kept`` (None for tasks without needles), and the ``seed`` of its
sample; ``needle_kept_layers`` (each full-attention layer's share) where ``markdown_needles``
reads it.

Intervals are 95% percentile bootstraps over samples, not answers: the answers to one sample's
questions share its context and move together. A sample is (task, target_tokens, seed), which
the evaluator's records carry (``kvfn_eval.tasks.generate`` makes a sample from them). A record
without a ``seed`` counts as a sample of its own, numbered by its order among the records of its
(mode, length, task, method, budget), so that the k-th answer of one method pairs with the k-th
of another. Each cell's draws come from a generator seeded by ``seed`` and the cell's key, so an
interval does not change when other methods are added. Fewer than two samples give no interval.
"""

import json
import zlib
from collections import defaultdict
from pathlib import Path
from statistics import mean
from typing import Iterable, Optional, Sequence

import numpy as np

KEY = ("mode", "target_tokens", "task", "method", "budget")
REFERENCES = ("snapkv", "streaming")  # the policies every other is compared with
LEVEL = 0.95
RESAMPLES = 2000
SEED = 0


def sample_ids(records: Sequence[dict]) -> list:
    """Each record's sample within its (mode, length, task, method, budget): its seed, or for
    a record without one, its order there."""
    order: dict[tuple, int] = defaultdict(int)
    ids = []
    for r in records:
        if r.get("seed") is not None:
            ids.append(("seed", r["seed"]))
            continue
        key = tuple(r[k] for k in KEY)
        ids.append(("order", order[key]))
        order[key] += 1
    return ids


def _per_sample(records: Sequence[dict]) -> dict[tuple, dict]:
    """(mode, length, task, method, budget) -> sample -> its answers' scores."""
    groups: dict[tuple, dict] = defaultdict(lambda: defaultdict(list))
    for r, sample in zip(records, sample_ids(records)):
        groups[tuple(r[k] for k in KEY)][sample].append(r["score"])
    return groups


def _rng(seed: int, *key) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(json.dumps(key).encode())])


def _draws(values: np.ndarray, weights: np.ndarray, rng, resamples: int) -> Optional[np.ndarray]:
    """The weighted mean of ``values`` (one a sample) over ``resamples`` resamplings of the
    samples; None for fewer than two samples."""
    if len(values) < 2:
        return None
    idx = rng.integers(0, len(values), size=(resamples, len(values)))
    return (values[idx] * weights[idx]).sum(axis=1) / weights[idx].sum(axis=1)


def _bounds(draws: Optional[np.ndarray], level: float) -> tuple:
    if draws is None:
        return None, None
    lo, hi = np.quantile(draws, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def _average(cells: list[dict], draws: list, level: float) -> tuple:
    """The macro-average of task cells, its interval from their draws (each task's samples
    resampled on their own)."""
    value = mean(c["score"] for c in cells)
    if any(d is None for d in draws):
        return value, None, None
    return (value, *_bounds(100 * np.mean(draws, axis=0), level))


def summarize(records: Iterable[dict], *, seed: int = SEED, resamples: int = RESAMPLES,
              level: float = LEVEL) -> list[dict]:  # fmt: skip
    """Mean score (percent) with its bootstrap interval (``lo``, ``hi``; None with one sample),
    KV fraction and needle rows kept per (mode, length, task, method, budget), plus the
    macro-average over tasks as task ``"average"``. ``n`` counts answers, ``samples`` samples."""
    records = list(records)
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[tuple(r[k] for k in KEY)].append(r)
    per_sample = _per_sample(records)
    rows, draws = [], {}
    for key, rs in groups.items():
        scores = list(per_sample[key].values())
        draws[key] = _draws(np.array([mean(s) for s in scores]), np.array([len(s) for s in scores]),
                            _rng(seed, *key), resamples)  # fmt: skip
        lo, hi = _bounds(draws[key], level)
        kept = [r["needle_kept"] for r in rs if r.get("needle_kept") is not None]
        rows.append(dict(zip(KEY, key), n=len(rs), samples=len(scores),
                         score=100 * mean(r["score"] for r in rs),
                         lo=None if lo is None else 100 * lo, hi=None if hi is None else 100 * hi,
                         kv_fraction=mean(r["kv_fraction"] for r in rs),
                         needle_kept=mean(kept) if kept else None))  # fmt: skip
    by_task: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        by_task[tuple(row[k] for k in KEY if k != "task")].append(row)
    for key, rs in by_task.items():
        kept = [r["needle_kept"] for r in rs if r["needle_kept"] is not None]
        score, lo, hi = _average(rs, [draws[tuple(r[k] for k in KEY)] for r in rs], level)
        rows.append(dict(zip([k for k in KEY if k != "task"], key), task="average",
                         n=sum(r["n"] for r in rs), samples=sum(r["samples"] for r in rs),
                         score=score, lo=lo, hi=hi,
                         kv_fraction=mean(r["kv_fraction"] for r in rs),
                         needle_kept=mean(kept) if kept else None))  # fmt: skip
    return sorted(rows, key=_order)


def differences(records: Iterable[dict], references: Sequence[str] = REFERENCES, *,
                seed: int = SEED, resamples: int = RESAMPLES, level: float = LEVEL) -> list[dict]:  # fmt: skip
    """Paired differences in points (percent) of every evicting method against each reference
    policy at the same mode, length, task and budget, over the samples both answered: per
    sample, the method's mean score minus the reference's; their mean (weighted by the
    sample's answers) and its bootstrap interval (``lo``, ``hi``; None with one sample); plus
    the macro-average over tasks as task ``"average"``. Methods that keep every row (budget
    None) have no counterpart."""
    per_sample = _per_sample(list(records))
    rows, draws = [], {}
    for key, samples in per_sample.items():
        mode, length, task, method, budget = key
        for ref in references:
            theirs = per_sample.get((mode, length, task, ref, budget))
            if budget is None or theirs is None:
                continue
            common = [s for s in samples if s in theirs]
            if not common:
                continue
            diff = np.array([mean(samples[s]) - mean(theirs[s]) for s in common])
            weights = np.array([len(samples[s]) for s in common])
            cell = (*key, ref)
            draws[cell] = _draws(diff, weights, _rng(seed, "difference", *cell), resamples)
            lo, hi = _bounds(draws[cell], level)
            rows.append(dict(zip(KEY, key), reference=ref, samples=len(common),
                             difference=100 * float(np.average(diff, weights=weights)),
                             lo=None if lo is None else 100 * lo,
                             hi=None if hi is None else 100 * hi))  # fmt: skip
    by_task: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        by_task[(*(row[k] for k in KEY if k != "task"), row["reference"])].append(row)
    for key, rs in by_task.items():
        cells = [dict(score=r["difference"]) for r in rs]
        value, lo, hi = _average(cells, [draws[(*(r[k] for k in KEY), key[-1])] for r in rs],
                                 level)  # fmt: skip
        rows.append(dict(zip([k for k in KEY if k != "task"], key[:-1]), task="average",
                         reference=key[-1], samples=sum(r["samples"] for r in rs),
                         difference=value, lo=lo, hi=hi))  # fmt: skip
    return sorted(rows, key=lambda r: (r["reference"], *_order(r)))


def leaders(records: Iterable[dict], summary: Optional[Sequence[dict]] = None, *, seed: int = SEED,
            resamples: int = RESAMPLES, level: float = LEVEL) -> list[dict]:  # fmt: skip
    """Per (mode, length, budget), the evicting method whose macro-average answers most
    (``method``, ``score``, ``lo``, ``hi``; ties go to the first name) and the one after it
    (``second``, ``second_score``), with the leader's paired difference from it in points
    (``difference``, ``difference_lo``, ``difference_hi``): whether a lead is clear is whether
    that interval leaves out zero. None where one method ran, or no sample has both.
    ``summary``: ``summarize(records)`` with the same settings, if the caller has it."""
    records = list(records)
    if summary is None:
        summary = summarize(records, seed=seed, resamples=resamples, level=level)
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for row in summary:
        if row["task"] == "average" and row["budget"] is not None:
            cells[(row["mode"], row["target_tokens"], row["budget"])].append(row)
    out = []
    for (mode, length, budget), rows in sorted(cells.items()):
        best, *rest = sorted(rows, key=lambda r: (-r["score"], r["method"]))
        row = dict(mode=mode, target_tokens=length, budget=budget, method=best["method"],
                   score=best["score"], lo=best["lo"], hi=best["hi"], second=None,
                   second_score=None, difference=None, difference_lo=None, difference_hi=None)  # fmt: skip
        if rest:
            second = rest[0]["method"]
            pair = [r for r in records if (r["mode"], r["target_tokens"], r["budget"]) ==
                    (mode, length, budget) and r["method"] in (best["method"], second)]  # fmt: skip
            diffs = differences(pair, (second,), seed=seed, resamples=resamples, level=level)
            diff = next(
                (d for d in diffs if d["task"] == "average" and d["method"] != second),
                dict(difference=None, lo=None, hi=None),
            )  # no sample answered by both
            row.update(second=second, second_score=rest[0]["score"],
                       difference=diff["difference"], difference_lo=diff["lo"],
                       difference_hi=diff["hi"])  # fmt: skip
        out.append(row)
    return out


def _order(row: dict):
    budget = row["budget"] if row["budget"] is not None else -1
    return (row["mode"], row["target_tokens"], row["task"] == "average", row["task"],
            row["method"] != "full", row["method"], budget)  # fmt: skip


def _number(value: float, sign: str = "", short: bool = False) -> str:
    """One decimal; ``short``: two significant figures at most (78, 5.6, +0.3)."""
    return f"{value:{sign}.0f}" if short and abs(value) >= 9.95 else f"{value:{sign}.1f}"


def _interval(value: float, lo: Optional[float], hi: Optional[float], sign: str = "",
              short: bool = False) -> str:  # fmt: skip
    text = _number(value, sign, short)
    if lo is None:
        return text
    return f"{text} [{_number(lo, sign, short)}, {_number(hi, sign, short)}]"


def _cell(row: Optional[dict]) -> str:
    if row is None:
        return ""
    return f"{_interval(row['score'], row['lo'], row['hi'])} ({100 * row['kv_fraction']:.0f}%)"


def _budget_name(budget) -> str:
    if budget is None:
        return "all rows"
    return f"{100 * budget:g}%" if budget < 1 else str(budget)


def _table(title: str, rows: Sequence[dict], cell, all_rows: bool) -> list[str]:
    """A table a mode: a row per (length, method) with its samples (the most of any budget's),
    a column per budget (after "all rows")."""
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
    out = []
    for mode in sorted({r["mode"] for r in rows}):
        cells: dict[tuple, dict] = {}
        lines: list[tuple] = []
        for r in rows:
            if r["mode"] != mode:
                continue
            line = (r["target_tokens"], r["method"])
            if line not in lines:
                lines.append(line)
            cells[(*line, r["budget"])] = r
        columns = [None, *budgets] if all_rows else budgets
        head = ["tokens", "method", "samples", *map(_budget_name, columns)]
        out += [title.format(mode=mode), "", "| " + " | ".join(head) + " |",
                "|" + "---|" * len(head)]  # fmt: skip
        for length, method in lines:
            got = [cells[length, method, b] for b in columns if (length, method, b) in cells]
            values = [cell(cells.get((length, method, b))) for b in columns]
            n = max(r["samples"] for r in got)
            out.append(f"| {length} | {method} | {n} | " + " | ".join(values) + " |")
        out.append("")
    return out


def markdown(summary: Sequence[dict], task: str = "average") -> str:
    """One table per mode: a row per (length, method), a column per budget; a cell is
    "accuracy % [95% interval] (KV bytes as % of the full cache)", the interval left out where
    there is one sample. Methods that keep every row (full, KV quantization alone) fill the
    "all rows" column."""
    rows = [r for r in summary if r["task"] == task]
    return "\n".join(_table(f"**{task}, query-{{mode}}**", rows, _cell, all_rows=True))


def markdown_differences(diffs: Sequence[dict], task: str = "average") -> str:
    """Per reference and mode, a table of paired differences in points, "difference [95%
    interval]" (a positive one: better than the reference), a column per budget; the
    reference's own row (0 [0, 0]) left out."""
    out = []
    for ref in sorted({d["reference"] for d in diffs}):
        rows = [d for d in diffs if d["task"] == task and d["reference"] == ref
                and d["method"] != ref]  # fmt: skip

        def cell(row):
            return "" if row is None else _interval(row["difference"], row["lo"], row["hi"], "+")

        title = f"**{task}, query-{{mode}}: points over {ref}, paired by sample**"
        out += _table(title, rows, cell, all_rows=False)
    return "\n".join(out)


def markdown_leaders(rows: Sequence[dict]) -> str:
    """Per mode, a table of who answers most: a row per length, a column per budget; a cell is
    "leader score [95% interval], difference [95% interval] over the second" (or "tied with
    the second (difference)" where their means are equal)."""
    out = []
    budgets = sorted({r["budget"] for r in rows})
    for mode in sorted({r["mode"] for r in rows}):
        cells = {(r["target_tokens"], r["budget"]): r for r in rows if r["mode"] == mode}
        head = ["tokens", *map(_budget_name, budgets)]
        out += [f"**who answers most, query-{mode}: the leader, then its paired lead over the "
                "second**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]  # fmt: skip
        for length in sorted({t for t, _ in cells}):
            values = []
            for budget in budgets:
                r = cells.get((length, budget))
                if r is None:
                    values.append("")
                    continue
                text = f"{r['method']} {_interval(r['score'], r['lo'], r['hi'])}"
                if r["difference"] is not None:
                    lead = _interval(r["difference"], r["difference_lo"], r["difference_hi"], "+")
                    tied = r["second_score"] == r["score"]
                    text += (
                        f", tied with {r['second']} ({lead})"
                        if tied
                        else f", {lead} over {r['second']}"
                    )
                values.append(text)
            out.append(f"| {length} | " + " | ".join(values) + " |")
        out.append("")
    return "\n".join(out)


def _tokens(length: int) -> str:
    return f"{length // 1024}K" if length % 1024 == 0 else str(length)


def markdown_budget(summary: Sequence[dict], budget, task: str = "average") -> str:
    """One budget across lengths: a row per (mode, length) with the full cache's score, a
    column per evicting method (the best first, by its mean over the rows), "score [95%
    interval]" to two figures, the row's best in bold."""
    rows = [r for r in summary if r["task"] == task]
    cells = {(r["mode"], r["target_tokens"], r["method"]): r for r in rows if r["budget"] == budget}
    full = {(r["mode"], r["target_tokens"]): r for r in rows if r["method"] == "full"}
    lines = sorted({k[:2] for k in cells}, key=lambda k: (k[0] != "aware", k))
    by_method = defaultdict(list)
    for (_, _, method), r in cells.items():
        by_method[method].append(r["score"])
    methods = sorted(by_method, key=lambda m: (-mean(by_method[m]), m))
    out = [
        "| mode, tokens (full) | " + " | ".join(methods) + " |",
        "|" + "---|" * (len(methods) + 1),
    ]
    for mode, length in lines:
        got = [cells.get((mode, length, m)) for m in methods]
        best = max(r["score"] for r in got if r is not None)
        values = []
        for r in got:
            text = "" if r is None else _interval(r["score"], r["lo"], r["hi"], short=True)
            values.append(f"**{text}**" if r is not None and r["score"] == best else text)
        label = f"{mode}, {_tokens(length)}"
        if (mode, length) in full:
            f = full[(mode, length)]
            label += f" ({_interval(f['score'], f['lo'], f['hi'], short=True)})"
        out.append(f"| {label} | " + " | ".join(values) + " |")
    return "\n".join(out)


def markdown_pairs(diffs: Sequence[dict], pairs: Sequence[tuple], task: str = "average") -> str:
    """Chosen paired differences across lengths: a row per (mode, method, budget, reference)
    of ``pairs``, a column per length, "difference [95% interval]" to two figures."""
    cells = {(d["mode"], d["method"], d["budget"], d["reference"], d["target_tokens"]): d
             for d in diffs if d["task"] == task}  # fmt: skip
    lengths = sorted({k[-1] for k in cells})
    out = ["| mode, policy, budget, from | " + " | ".join(map(_tokens, lengths)) + " |",
           "|" + "---|" * (len(lengths) + 1)]  # fmt: skip
    for mode, method, budget, reference in pairs:
        got = [cells.get((mode, method, budget, reference, n)) for n in lengths]
        if not any(got):
            raise ValueError(f"no paired difference for {method} from {reference} at "
                             f"{_budget_name(budget)}, query-{mode}")  # fmt: skip
        values = ["" if d is None else _interval(d["difference"], d["lo"], d["hi"], "+", True)
                  for d in got]  # fmt: skip
        label = f"{mode}, {method}, {_budget_name(budget)}, from {reference}"
        out.append(f"| {label} | " + " | ".join(values) + " |")
    return "\n".join(out)


def markdown_needles(records: Iterable[dict], mode: str, budget) -> str:
    """Where one budget's needle rows go, in one mode: a row per (length, method) with its
    answers' mean score, the needle rows' share kept over every full-attention layer and KV
    head, that share in the layer keeping least of it and in the layer keeping most, and the
    latter layer (the most frequent); means over answers, from records that carry
    ``needle_kept_layers``."""
    cells = defaultdict(list)
    for r in records:
        if r["mode"] == mode and r["budget"] == budget and r.get("needle_kept_layers"):
            cells[(r["target_tokens"], r["method"])].append(r)
    if not cells:
        raise ValueError(f"no records with needle_kept_layers at {_budget_name(budget)}, "
                         f"query-{mode}")  # fmt: skip
    out = ["| tokens | method | answers | score | needle rows kept | in the layer keeping least "
           "| in the layer keeping most | that layer |", "|---" * 8 + "|"]  # fmt: skip
    for (length, method), rs in sorted(cells.items()):
        layers = [r["needle_kept_layers"] for r in rs]
        most = [int(np.argmax(k)) for k in layers]
        score = 100 * mean(r["score"] for r in rs)
        out.append(
            f"| {_tokens(length)} | {method} | {len(rs)} | {score:.1f} "
            f"| {mean(r['needle_kept'] for r in rs):.3f} | {mean(min(k) for k in layers):.3f} "
            f"| {mean(max(k) for k in layers):.3f} | {max(set(most), key=most.count)} |"
        )
    return "\n".join(out)


def styles(methods: Sequence[str]) -> dict:
    """A (colour, marker, line style) per method, distinct for up to 30 methods and the same in
    every panel: ten colours, then the ten again with other markers and lines."""
    from matplotlib import colormaps

    colours = colormaps["tab10"].colors
    shapes = [("o", "-"), ("^", ":"), ("s", "--")]
    return {m: (colours[i % 10], *shapes[(i // 10) % 3]) for i, m in enumerate(methods)}


def plot(summary: Sequence[dict], path_prefix: str) -> list[str]:
    """One PNG per (mode, length): a panel per task, accuracy vs KV bytes (% of the full
    cache, log scale), a line per evicting method, a point per method that keeps every row
    and a dashed line at the full cache's accuracy. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullFormatter, ScalarFormatter

    written = []
    style = styles(sorted({r["method"] for r in summary} - {"full"}))
    for mode, length in sorted({(r["mode"], r["target_tokens"]) for r in summary}):
        rows = [r for r in summary if r["mode"] == mode and r["target_tokens"] == length]
        tasks = sorted({r["task"] for r in rows}, key=lambda t: (t == "average", t))
        cols = min(4, len(tasks))
        fig, axes = plt.subplots((len(tasks) + cols - 1) // cols, cols, squeeze=False,
                                 figsize=(4 * cols, 3.2 * ((len(tasks) + cols - 1) // cols)))  # fmt: skip
        for ax, task in zip(axes.flat, tasks):
            for method in sorted({r["method"] for r in rows}):
                pts = sorted((100 * r["kv_fraction"], r["score"]) for r in rows
                             if r["task"] == task and r["method"] == method)  # fmt: skip
                if not pts:
                    continue
                x, y = zip(*pts)
                if method == "full":
                    ax.axhline(y[0], color="black", linestyle="--", linewidth=1, label="full")
                elif len(pts) == 1:  # keeps every row (KV quantization alone): one point
                    ax.plot(x, y, marker="s", markersize=8, linestyle="", zorder=3,
                            color=style[method][0], label=method)  # fmt: skip
                else:
                    colour, marker, line = style[method]
                    ax.plot(x, y, color=colour, marker=marker, linestyle=line, label=method)
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(FixedLocator([1, 3, 6, 12, 25, 50, 100]))
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_title(task, fontsize=10)
            ax.set_ylim(-5, 105)
            ax.set_xlabel("KV bytes, % of full cache")
            ax.set_ylabel("accuracy %")
        for ax in list(axes.flat)[len(tasks) :]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=7)
        fig.suptitle(f"query-{mode}, {length}-token prompts")
        fig.tight_layout()
        path = f"{path_prefix}-{mode}-{length}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def main(argv=None) -> None:
    """Print cross-sections of a saved result: one budget's table across lengths, chosen
    paired differences, and who answers most."""
    import argparse
    import gzip

    p = argparse.ArgumentParser(prog="python -m kvfn_eval.report", description=main.__doc__)
    p.add_argument("result", help="a result evaluate.py wrote (OUT.json or OUT.json.gz)")
    p.add_argument("--budget", type=float, action="append", default=[],
                   help="a budget (a fraction, or rows) to tabulate across lengths")  # fmt: skip
    p.add_argument(
        "--pair",
        action="append",
        default=[],
        metavar="MODE:METHOD:BUDGET:FROM",
        help="a paired difference across lengths, e.g. aware:chunkkv:0.125:snapkv",
    )
    p.add_argument("--needles", action="append", default=[], metavar="MODE:BUDGET",
                   help="the needle rows' share kept, overall and in the layers keeping least "
                        "and most, per length and method, e.g. agnostic:0.25")  # fmt: skip
    p.add_argument("--leaders", action="store_true",
                   help="who answers most, per cell (what prints when nothing else is asked)")  # fmt: skip
    args = p.parse_args(argv)
    try:
        data = Path(args.result).read_bytes()
        result = json.loads(gzip.decompress(data) if args.result.endswith(".gz") else data)
        records = result["records"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        p.error(f"argument result: {args.result!r} is not a result evaluate.py wrote ({e})")
    pairs = []
    for pair in args.pair:
        parts = pair.split(":")
        try:
            pairs.append((parts[0], parts[1], _budget(parts[2]), parts[3]))
        except (IndexError, ValueError):
            p.error(f"argument --pair: expected MODE:METHOD:BUDGET:FROM, got {pair!r}")
        if len(parts) != 4:
            p.error(f"argument --pair: expected MODE:METHOD:BUDGET:FROM, got {pair!r}")
    summary = summarize(records)
    for budget in args.budget:
        budget = _budget(budget)
        if not any(r["budget"] == budget for r in summary):
            p.error(f"argument --budget: no method ran at {budget:g} in {args.result!r}")
        print(markdown_budget(summary, budget), end="\n\n")
    if pairs:
        try:
            print(markdown_pairs(differences(records, sorted({q[-1] for q in pairs})), pairs),
                  end="\n\n")  # fmt: skip
        except ValueError as e:
            p.error(f"argument --pair: {e}")
    for needles in args.needles:
        mode, _, budget = needles.partition(":")
        try:
            print(markdown_needles(records, mode, _budget(budget)), end="\n\n")
        except ValueError as e:
            p.error(f"argument --needles: expected MODE:BUDGET with records that carry "
                    f"needle_kept_layers, got {needles!r} ({e})")  # fmt: skip
    if args.leaders or not (args.budget or pairs or args.needles):
        print(markdown_leaders(leaders(records, summary)))


def _budget(text):
    """A budget as the records hold it: a fraction (float) or rows (int)."""
    value = float(text)
    return int(value) if value >= 1 and value == int(value) else value


if __name__ == "__main__":
    main()
