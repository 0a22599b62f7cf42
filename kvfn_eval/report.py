"""Evaluation records to summaries, markdown tables and plots (pure, except ``plot`` writes).

A record is one answer: a dict with at least ``mode``, ``target_tokens``, ``task``, ``method``,
``budget`` (None for methods that keep every row), ``score``, ``kv_fraction`` (KV bytes over
the full cache's) and ``needle_kept`` (None for tasks without needles).
"""

from collections import defaultdict
from statistics import mean
from typing import Iterable, Optional, Sequence

KEY = ("mode", "target_tokens", "task", "method", "budget")


def summarize(records: Iterable[dict]) -> list[dict]:
    """Mean score (percent), KV fraction and needle rows kept per (mode, length, task, method,
    budget), plus the macro-average over tasks as task ``"average"``."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[tuple(r[k] for k in KEY)].append(r)
    rows = []
    for key, rs in groups.items():
        kept = [r["needle_kept"] for r in rs if r.get("needle_kept") is not None]
        rows.append(dict(zip(KEY, key), n=len(rs), score=100 * mean(r["score"] for r in rs),
                         kv_fraction=mean(r["kv_fraction"] for r in rs),
                         needle_kept=mean(kept) if kept else None))  # fmt: skip
    by_task: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        by_task[tuple(row[k] for k in KEY if k != "task")].append(row)
    for key, rs in by_task.items():
        kept = [r["needle_kept"] for r in rs if r["needle_kept"] is not None]
        rows.append(dict(zip([k for k in KEY if k != "task"], key), task="average",
                         n=sum(r["n"] for r in rs), score=mean(r["score"] for r in rs),
                         kv_fraction=mean(r["kv_fraction"] for r in rs),
                         needle_kept=mean(kept) if kept else None))  # fmt: skip
    return sorted(rows, key=_order)


def _order(row: dict):
    budget = row["budget"] if row["budget"] is not None else -1
    return (row["mode"], row["target_tokens"], row["task"] == "average", row["task"],
            row["method"] != "full", row["method"], budget)  # fmt: skip


def _cell(row: Optional[dict]) -> str:
    if row is None:
        return ""
    return f"{row['score']:.1f} ({100 * row['kv_fraction']:.0f}%)"


def markdown(summary: Sequence[dict], task: str = "average") -> str:
    """One table per mode: a row per (length, method), a column per budget; a cell is
    "accuracy % (KV bytes as % of the full cache)". Methods that keep every row (full, KV
    quantization alone) fill the "all rows" column."""
    rows = [r for r in summary if r["task"] == task]
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
        head = ["tokens", "method", "all rows", *map(str, budgets)]
        out += [f"**{task}, query-{mode}**", "", "| " + " | ".join(head) + " |",
                "|" + "---|" * len(head)]  # fmt: skip
        for length, method in lines:
            values = [_cell(cells.get((length, method, b))) for b in [None, *budgets]]
            out.append(f"| {length} | {method} | " + " | ".join(values) + " |")
        out.append("")
    return "\n".join(out)


def plot(summary: Sequence[dict], path_prefix: str) -> list[str]:
    """One PNG per (mode, length): a panel per task, accuracy vs KV bytes (% of the full
    cache, log scale), a line per evicting method, a point per method that keeps every row
    and a dashed line at the full cache's accuracy. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullFormatter, ScalarFormatter

    written = []
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
                    ax.plot(x, y, marker="s", markersize=8, linestyle="", zorder=3, label=method)
                else:
                    ax.plot(x, y, marker="o", label=method)
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
