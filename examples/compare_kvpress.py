"""kvfn's SnapKV against NVIDIA kvpress's SnapKVPress: same model, same prompts, same budget.

No published kvpress row exists for the models kvfn ships (its published rows are 7-8B models),
so this runs kvpress itself (PyTorch, the published benchmark's own code) and kvfn (MLX) on the
same GGUF model, both dequantized to float32, on identical token ids of kvfn's RULER-style tasks,
under kvpress's protocol (query-agnostic: the context is prefilled and compressed, then each
question is appended and greedily decoded on the compressed cache), and reports:

* the kept sets: per layer and KV head, the Jaccard overlap of the prompt positions each keeps;
* the answers: each one's accuracy (``kvfn_eval.answers.match_all``), and how often the two
  give the same answer; the full cache's answers of both as the reference;
* the full-cache logit check: the largest difference of the first answer token's logits.

NOT a kvfn dependency: it needs a separate venv with torch, transformers (a version kvpress
supports, < 5.3), kvpress (from source) and kvfn. On the CPU machine, as it was built for the
results in examples/results/kvpress-compare.md::

    python3.11 -m venv /tmp/kvp
    /tmp/kvp/bin/pip install torch==2.13.0                 # the CPU build (never plain `torch`)
    /tmp/kvp/bin/pip install -e ".[qwen,eval]"             # kvfn, mlx, mlx-lm, the 0.5B weights
    /tmp/kvp/bin/pip install "transformers==5.2.0" gguf "datasets>=2.21" "peft>=0.20" \
        "accelerate>=1,<2" "cachetools>=5.5.2,<6" "pandas>=2.2.2,<3" "fire>=0.6,<0.7"
    /tmp/kvp/bin/pip uninstall -y kernels   # pulled in for mlx-lm's newer transformers; 5.2
                                            # fails to import next to kernels 0.19
    git clone https://github.com/NVIDIA/kvpress /tmp/kvpress-src   # tested at 8bb29b9
    /tmp/kvp/bin/pip install --no-deps -e /tmp/kvpress-src
    /tmp/kvp/bin/python examples/compare_kvpress.py --samples 10 --tasks niah_single \
        niah_multikey --length 4096 --compression 0.75 0.875 --out examples/results/kvpress-compare

(mlx-lm 0.32 asks for transformers >= 5.7 and kvpress for < 5.3; kvfn's loading and mlx-lm's
tokenizer wrapper run fine on 5.2, pip's warning notwithstanding.)

How each side runs, per sample (a context and its questions):

* kvpress: the context is prefilled once without a press through ``model.model`` (as
  ``KVPressTextGenerationPipeline._forward`` prefills), with a forward hook on every attention
  layer recording the ``hidden_states`` and keyword arguments the press's own hook would see;
  then, per compression ratio, ``SnapKVPress.compress`` (kvpress's scoring, top-k and gather)
  is called on each layer's full keys and values with exactly those arguments (attentions
  None, as under sdpa), and the answers are decoded by the pipeline's own
  ``generate_answer`` / ``_remove_answer_from_cache``. The kept positions are recorded by a
  subclass whose ``score`` returns kvpress's scores unchanged and notes
  ``scores.topk(n_kept)``, the very call ``ScorerPress.compress`` makes. On the first sample
  the compressed caches are checked equal, element for element, to those of a real
  ``with press(model): model.model(...)`` prefill (``validated`` in the JSON).
* kvfn: ``kvfn.prefill`` of the context but its last ``window`` tokens, ``kvfn.scored_prefill``
  of those (the evaluator's query-agnostic path), ``kvfn.compact_states`` with a
  ``kvfn.SnapKV`` set as close to kvpress's as its fields allow, answers decoded by
  ``kvfn_eval.evaluator.kvfn_greedy`` (kvfn's own steps, as the evaluator decodes evicted
  states).

Settings that cannot match (the table's notes say what each costs): kvfn marks the window kept
with +inf, kvpress with max + 1 (the same rows); kvfn selects with argpartition, kvpress with
topk (only exact ties could differ). Before 8525781 kvfn also pooled every prompt column, the
window's too, where kvpress pools only the columns before the window: the results in
examples/results/kvpress-compare.md were made then and show that difference.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF dequantization bar

import kvfn  # noqa: E402  isort: skip  (puts OpenBLAS in front before mlx loads)
import kvfn_models  # noqa: E402
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from kvfn_eval import answers, tasks  # noqa: E402
from kvfn_eval.evaluator import (  # noqa: E402
    ANSWER_TOKENS,
    head_positions,
    kvfn_greedy,
    prompt_tokens,
    token_counter,
)

try:
    import kvpress
    import torch
    import transformers
    from kvpress import KVPressTextGenerationPipeline, SnapKVPress
    from transformers import AutoModelForCausalLM, DynamicCache
except ImportError as e:  # pragma: no cover - the message is the point
    sys.exit(f"{e}: this script needs a venv with torch + kvpress (see the docstring: {__file__})")

KVPRESS_WINDOW, KVPRESS_KERNEL = 64, 5  # SnapKVPress's defaults


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="a kvfn_models name or .gguf")
    p.add_argument("--tasks", nargs="+", default=["niah_single", "niah_multikey"])
    p.add_argument("--samples", type=int, default=10, help="samples per task")
    p.add_argument("--length", type=int, default=4096, help="target prompt tokens")
    p.add_argument("--compression", type=float, nargs="+", default=[0.75],
                   help="kvpress compression ratios (fraction removed)")  # fmt: skip
    p.add_argument("--questions", type=int, default=2, help="questions per multi-key sample")
    p.add_argument("--seed", type=int, default=1, help="sample i's seed: seed * 10000 + i")
    p.add_argument("--window", type=int, default=KVPRESS_WINDOW)
    p.add_argument("--kernel", type=int, default=KVPRESS_KERNEL)
    p.add_argument("--prefill-step-size", type=int, default=512, help="kvfn's prefill chunks")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--no-validate", action="store_true",
                   help="skip the first sample's check against a hooked prefill")  # fmt: skip
    p.add_argument("--kvpress-commit", default=None, help="recorded in the output")
    p.add_argument("--out", default="kvpress-compare", help="output prefix (.json, .md)")
    p.add_argument("--report", metavar="JSON",
                   help="run nothing: rewrite the .md beside an earlier run's JSON")  # fmt: skip
    args = p.parse_args(argv)
    for t in args.tasks:
        if t not in tasks.TASKS:
            p.error(f"unknown task {t!r} (choose from {', '.join(tasks.TASKS)})")
    for c in args.compression:
        if not 0 < c < 1:
            p.error(f"--compression must lie in (0, 1), got {c}")
    return args


# -- kvpress ----------------------------------------------------------------------------------


class RecordingSnapKV(SnapKVPress):
    """SnapKVPress, unchanged, that notes its scores and the rows ``ScorerPress.compress``
    keeps (the same ``topk`` call on the same scores)."""

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        scores = super().score(module, hidden_states, keys, values, attentions, kwargs)
        n_kept = int(keys.shape[2] * (1 - self.compression_ratio))
        kept = scores.topk(n_kept, dim=-1).indices[0].sort(dim=-1).values
        self.record[module.layer_idx] = (scores[0].clone(), kept.numpy())
        return scores


def make_press(ratio: float, window: int, kernel: int) -> RecordingSnapKV:
    press = RecordingSnapKV(compression_ratio=ratio, window_size=window, kernel_size=kernel)
    press.record = {}
    return press


def torch_prefill(hf, context: list[int]):
    """The full cache of ``context`` and, per layer, the arguments the press's hook sees."""
    seen = {}

    def capture(module, args, kwargs, output):
        seen[module.layer_idx] = (kwargs["hidden_states"], dict(kwargs), output[1])

    hooks = [layer.self_attn.register_forward_hook(capture, with_kwargs=True)
             for layer in hf.model.layers]  # fmt: skip
    cache = DynamicCache()
    try:
        with torch.inference_mode():
            hf.model(input_ids=torch.tensor([context]), past_key_values=cache)
    finally:
        for h in hooks:
            h.remove()
    return cache, seen


def torch_compress(hf, press, full, seen) -> "DynamicCache":
    """A new cache: ``press.compress`` on each layer's full keys and values, with the hook's
    arguments (``BasePress.forward_hook`` without its cache plumbing)."""
    out = DynamicCache()
    with torch.inference_mode():
        for i, layer in enumerate(hf.model.layers):
            hidden, kwargs, attentions = seen[i]
            keys, values = full.layers[i].keys, full.layers[i].values
            k, v = press.compress(layer.self_attn, hidden, keys, values, attentions, kwargs)
            out.update(k, v, i)
    return out


def torch_answers(pipe, cache, tails, context_length: int, n_new: int) -> list[str]:
    """kvpress's own greedy decode of each question on ``cache`` (left as it was)."""
    got = []
    with torch.inference_mode():
        for tail in tails:
            lengths = [cache.get_seq_length(i) for i in range(len(cache))]
            got.append(pipe.generate_answer(question_ids=torch.tensor([tail]), cache=cache,
                                            context_length=context_length,
                                            max_new_tokens=n_new))  # fmt: skip
            pipe._remove_answer_from_cache(cache, lengths)
    return got


def torch_first_logits(hf, pipe, cache, tail, context_length: int) -> np.ndarray:
    lengths = [cache.get_seq_length(i) for i in range(len(cache))]
    pos = torch.arange(context_length, context_length + len(tail))[None]
    with torch.inference_mode():
        out = hf(input_ids=torch.tensor([tail]), past_key_values=cache, position_ids=pos)
    pipe._remove_answer_from_cache(cache, lengths)
    return out.logits[0, -1].float().numpy()


def validate(hf, press_args, context, caches) -> bool:
    """Whether a real ``with press(model)`` prefill leaves exactly ``caches``' tensors."""
    ok = True
    for (ratio, window, kernel), mine in zip(press_args, caches):
        press = make_press(ratio, window, kernel)
        real = DynamicCache()
        with torch.inference_mode(), press(hf):
            hf.model(input_ids=torch.tensor([context]), past_key_values=real)
        same = all(
            torch.equal(real.layers[i].keys, mine.layers[i].keys)
            and torch.equal(real.layers[i].values, mine.layers[i].values)
            for i in range(len(real))
        )
        print(f"  validate ratio {ratio}: hooked prefill == direct compress: {same}", flush=True)
        ok &= same
    return ok


# -- comparison -------------------------------------------------------------------------------


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    inter = np.intersect1d(a, b).size
    return inter / (a.size + b.size - inter)


def compare_kept(ref: dict, kvfn_kept: list, ref_scores: dict, P: int, w: int) -> dict:
    """Per layer and KV head: Jaccard of the kept positions (all, and without the window both
    force), and where the rows kept by one side only lie."""
    jac, jac_mid, only, boundary, gap = [], [], 0, 0, 0.0
    for layer, heads in enumerate(kvfn_kept):
        scores = ref_scores[layer]
        row, row_mid = [], []
        for h, mine in enumerate(heads):
            theirs = ref[layer][h]
            row.append(jaccard(theirs, mine))
            row_mid.append(jaccard(theirs[theirs < P - w], mine[mine < P - w]))
            diff = np.setxor1d(theirs, mine)
            only += diff.size
            boundary += int(np.sum((diff >= P - w - KVPRESS_KERNEL // 2) & (diff < P - w)))
            inner = diff[diff < P - w - KVPRESS_KERNEL // 2]
            if inner.size:  # how far from kvpress's own cut the other rows score
                s = scores[h].numpy()
                cut = np.sort(s)[::-1][theirs.size - 1]
                gap = max(gap, float(np.max(np.abs(s[inner] - cut)) / abs(cut)))
        jac.append(row)
        jac_mid.append(row_mid)
    return dict(jaccard=jac, jaccard_mid=jac_mid, rows_differing=only,
                rows_differing_at_boundary=boundary, inner_gap_to_cut=gap)  # fmt: skip


def score_diff(ref_scores: dict, kvfn_scores: list, P: int, w: int) -> dict:
    """kvpress's scores (mean over the window) against kvfn's row scores / window (sum over
    it), on the columns both pool alike and on the columns next to the window."""
    edge = KVPRESS_KERNEL // 2
    inner, at_edge = [], []
    for layer, mine in enumerate(kvfn_scores):
        theirs = ref_scores[layer][:, : P - w].numpy()
        ours = mine[:, : P - w] / w
        scale = np.abs(theirs).max()
        inner.append(float(np.abs(theirs - ours)[:, : P - w - edge].max() / scale))
        at_edge.append(float(np.abs(theirs - ours)[:, P - w - edge :].max() / scale))
    return dict(score_rel_diff=inner, score_rel_diff_edge=at_edge)


def kvpress_rule(raw: mx.array, P: int, w: int, budget: int, n_kv: int, kernel: int) -> list:
    """The rows kvpress's rule keeps from kvfn's own window attention ``raw`` (1, n_heads, >= P):
    group mean, average pooling over the columns before the window only (zero padded), window
    kept: separates the pooling difference from everything else (scores, selection)."""
    s = np.array(raw[0, :, : P - w]).reshape(n_kv, -1, P - w).mean(axis=1)
    half = kernel // 2
    padded = np.pad(s, ((0, 0), (half, half)))
    pooled = sum(padded[:, i : i + P - w] for i in range(kernel)) / kernel
    top = np.argsort(-pooled, axis=-1, kind="stable")[:, : budget - w]
    return [np.sort(np.concatenate([t, np.arange(P - w, P)])) for t in top]


def needle_kept(kept: list, needles) -> float:
    rows = np.array([t for n in needles for t in n])
    if rows.size == 0:
        return float("nan")
    return float(np.mean([np.isin(rows, h).mean() for heads in kept for h in heads]))


# -- one sample -------------------------------------------------------------------------------


def run_sample(args, sample, tok, fm, hf, pipe, eos, check: bool) -> dict:
    prompts = [prompt_tokens(tok, sample, q) for q in sample.questions]
    head = prompts[0].head
    assert all(p.head == head for p in prompts), "questions must share the context's tokens"
    tails = [p.tail for p in prompts]
    refs = [q.answers for q in sample.questions]
    P, w = len(head), args.window
    n_new = ANSWER_TOKENS.get(sample.task, 32)
    timing = {}

    # kvfn: the evaluator's query-agnostic prefill, scored over the context's last w tokens
    t0 = time.perf_counter()
    capacity = P + max(len(t) for t in tails) + n_new
    start = kvfn.prefill(fm, mx.array([head[:-w]]), capacity=capacity,
                         prefill_step_size=args.prefill_step_size)  # fmt: skip
    states, scores = kvfn.scored_prefill(fm, mx.array([head[-w:]]), window=w, states=start,
                                         prefill_step_size=args.prefill_step_size)  # fmt: skip
    mx.eval(kvfn.tree.arrays(states), scores)
    timing["kvfn_prefill"] = time.perf_counter() - t0
    logits, _ = fm.forward(mx.array([tails[0]]), states)
    kvfn_logits = np.array(logits[0, -1].astype(mx.float32))
    kvfn_full = [tok.decode(kvfn_greedy(fm, t, states, n_new, eos)[0]) for t in tails]

    # kvpress: the pipeline's prefill, hook arguments recorded
    t0 = time.perf_counter()
    full, seen = torch_prefill(hf, head)
    timing["kvpress_prefill"] = time.perf_counter() - t0
    torch_logits = torch_first_logits(hf, pipe, full, tails[0], P)
    kvpress_full = torch_answers(pipe, full, tails, P, n_new)

    record = dict(
        task=sample.task, seed=sample.seed, target_tokens=sample.target_tokens, context_tokens=P,
        question_tokens=[len(t) for t in tails], references=[list(r) for r in refs],
        logit_max_abs_diff=float(np.abs(kvfn_logits - torch_logits).max()),
        logit_scale=float(np.abs(torch_logits).max()),
        first_token_same=bool(kvfn_logits.argmax() == torch_logits.argmax()),
        full=dict(kvpress=kvpress_full, kvfn=kvfn_full,
                  kvpress_score=[answers.match_all(a, r) for a, r in zip(kvpress_full, refs)],
                  kvfn_score=[answers.match_all(a, r) for a, r in zip(kvfn_full, refs)]),
        settings={}, timing=timing,
    )  # fmt: skip
    press_args, caches = [], []
    for ratio in args.compression:
        budget = int(P * (1 - ratio))  # kvpress's n_kept
        t0 = time.perf_counter()
        press = make_press(ratio, w, args.kernel)
        cache = torch_compress(hf, press, full, seen)
        timing[f"kvpress_compress_{ratio}"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        got_kvpress = torch_answers(pipe, cache, tails, P, n_new)
        timing[f"kvpress_answers_{ratio}"] = time.perf_counter() - t0

        policy = kvfn.SnapKV(budget=budget, window=w, sink_tokens=0, kernel_size=args.kernel,
                             pooling="avg", per_head=True, group_reduce="mean")  # fmt: skip
        t0 = time.perf_counter()
        compacted, _ = kvfn.compact_states(states, scores, policy)
        mx.eval(kvfn.tree.arrays(compacted))
        timing[f"kvfn_compact_{ratio}"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        got_kvfn = [tok.decode(kvfn_greedy(fm, t, compacted, n_new, eos)[0]) for t in tails]
        timing[f"kvfn_answers_{ratio}"] = time.perf_counter() - t0

        kvfn_kept = [[np.sort(p) for p in head_positions(s)] for s in compacted]
        H = compacted[0].keys.shape[1]
        kvfn_scores = [
            np.array(policy.row_scores(s[:, :, :P], prompt_length=P, n_kv_heads=H, batch=1,
                                       layer=i))[0]  # fmt: skip
            for i, s in enumerate(scores)
        ]
        ref_kept = {i: kept for i, (_, kept) in press.record.items()}
        ref_scores = {i: s for i, (s, _) in press.record.items()}
        assert all(k.shape == (H, budget) for k in ref_kept.values())
        assert all(len(h) == budget for heads in kvfn_kept for h in heads)
        rule = [kvpress_rule(s, P, w, budget, H, args.kernel) for s in scores]
        rule_jaccard = [[jaccard(ref_kept[i][h], k) for h, k in enumerate(heads)]
                        for i, heads in enumerate(rule)]  # fmt: skip
        needles = prompts[0].needles
        record["settings"][str(ratio)] = dict(
            budget=budget, kvpress=got_kvpress, kvfn=got_kvfn,
            kvpress_score=[answers.match_all(a, r) for a, r in zip(got_kvpress, refs)],
            kvfn_score=[answers.match_all(a, r) for a, r in zip(got_kvfn, refs)],
            agree=[a == b for a, b in zip(got_kvpress, got_kvfn)],
            needle_kept_kvpress=needle_kept([ref_kept[i] for i in range(len(ref_kept))], needles),
            needle_kept_kvfn=needle_kept(kvfn_kept, needles),
            **compare_kept(ref_kept, kvfn_kept, ref_scores, P, w),
            jaccard_kvfn_scores_kvpress_pooling=rule_jaccard,
            **score_diff(ref_scores, kvfn_scores, P, w),
        )  # fmt: skip
        press_args.append((ratio, w, args.kernel))
        caches.append(cache)
    if check:
        t0 = time.perf_counter()
        record["validated"] = validate(hf, press_args, head, caches)
        timing["validate"] = time.perf_counter() - t0
    return record


# -- report -----------------------------------------------------------------------------------


def pct(x) -> str:
    return f"{100 * float(np.mean(x)):.1f}"


def table(records: list, compressions: list) -> str:
    head = ("| task | compression (kept) | samples (answers) | kvpress full | kvfn full | kvpress "
            "SnapKV | kvfn SnapKV | same answer % | Jaccard mean | Jaccard min layer | Jaccard "
            "mid mean | needle rows kept kvpress / kvfn | Jaccard, kvfn's scores pooled as "
            "kvpress |")  # fmt: skip
    lines = [head, "|" + "---|" * 13]
    groups = sorted({r["task"] for r in records}, key=list(tasks.TASKS).index) + ["all"]
    for ratio in compressions:
        key = str(ratio)
        for task in groups:
            rs = [r for r in records if task in ("all", r["task"])]
            if not rs:
                continue
            cells = [r["settings"][key] for r in rs]
            flat = lambda f, src: [x for c in src for x in c[f]]  # noqa: E731
            jac = np.array([c["jaccard"] for c in cells])  # (samples, layers, heads)
            mid = np.array([c["jaccard_mid"] for c in cells])
            rule = np.array([c["jaccard_kvfn_scores_kvpress_pooling"] for c in cells])
            per_layer = jac.mean(axis=(0, 2))
            lines.append(
                f"| {task} | {ratio} ({100 * (1 - ratio):.1f}%) | {len(rs)} "
                f"({len(flat('kvpress_score', cells))}) | "
                f"{pct(flat('kvpress_score', [r['full'] for r in rs]))} | "
                f"{pct(flat('kvfn_score', [r['full'] for r in rs]))} | "
                f"{pct(flat('kvpress_score', cells))} | {pct(flat('kvfn_score', cells))} | "
                f"{pct(flat('agree', cells))} | {jac.mean():.5f} | "
                f"{per_layer.min():.5f} (L{per_layer.argmin()}) | {mid.mean():.5f} | "
                f"{np.mean([c['needle_kept_kvpress'] for c in cells]):.3f} / "
                f"{np.mean([c['needle_kept_kvfn'] for c in cells]):.3f} | {rule.mean():.5f} |"
            )
    return "\n".join(lines)


def versions(args) -> dict:
    def git(path):
        try:
            out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"],
                                 capture_output=True, text=True, check=True)  # fmt: skip
            return out.stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    return dict(
        python=platform.python_version(), machine=platform.machine(), torch=torch.__version__,
        transformers=transformers.__version__, mlx=mx.__version__,
        kvpress=args.kvpress_commit or git(Path(kvpress.__file__).parent) or "unknown",
        kvfn=git(Path(kvfn.__file__).parent) or "unknown",
    )  # fmt: skip


SETTINGS = [  # (setting, kvpress SnapKVPress, kvfn SnapKV here, matched)
    ("observation window", "last 64 context queries (`window_size=64`)", "`window=64`", "yes"),
    ("window attention", "softmax over every key the query sees (window keys too, causal), "
     "float32, then the window's columns dropped", "the same softmax "
     "(`kvfn.scores.window_attention_scores`), float32", "yes"),
    ("over the window's queries", "mean", "sum (a factor of 64: the same ranking)", "yes"),
    ("pooling", "`avg_pool1d(k=5, pad=2)`, zeros counted (/ 5)", "`pooling=\"avg\"`, "
     "`kernel_size=5`: zero padded, / 5", "yes, over other columns (below)"),
    ("query heads of a KV head", "mean (after pooling)", "`group_reduce=\"mean\"` (before "
     "pooling: linear, the same)", "yes"),
    ("one row set per", "KV head", "`per_head=True`", "yes"),
    ("attention sinks", "none", "`sink_tokens=0`", "yes"),
    ("window rows", "kept (scored max + 1)", "kept (scored +inf)", "yes"),
    ("rows kept a head", "`int(P * (1 - ratio))`, window included",
     "`budget=int(P * (1 - ratio))`, window included", "yes"),
    ("selection", "`topk`", "`argpartition`, sorted", "but for exact ties"),
    ("pooled columns", "the P - 64 columns before the window only (zero padding at their end)",
     "the same since 8525781 (before: all P columns, the window's too)", "yes"),
    ("decode", "`KVPressTextGenerationPipeline.generate_answer` (torch), stops at 151645",
     "`kvfn_eval.evaluator.kvfn_greedy` (kvfn's steps, MLX), stops at 151645", "greedy, same"),
    ("prompt", "token ids of `kvfn_eval.evaluator.prompt_tokens` (chat template; question and "
     "answer prefix after the context); kvpress's own `preprocess` is not used", "the same ids",
     "yes"),
]  # fmt: skip


def settings_table() -> str:
    rows = [f"| {' | '.join(row)} |" for row in SETTINGS]
    head = "| setting | kvpress SnapKVPress | kvfn SnapKV here | matched |"
    return "\n".join(["Settings:", "", head, "|---|---|---|---|", *rows])


def diagnostics(records: list, compressions: list) -> str:
    """Where the kept sets differ, and how closely the scores agree, in numbers."""
    lines = ["Diagnostics (every sample, layer and KV head):", ""]
    logit = max(r["logit_max_abs_diff"] for r in records)
    scale = min(r["logit_scale"] for r in records)
    same = sum(r["first_token_same"] for r in records)
    full = sum(a == b for r in records for a, b in zip(r["full"]["kvpress"], r["full"]["kvfn"]))
    n_full = sum(len(r["full"]["kvpress"]) for r in records)
    valid = [r["validated"] for r in records if "validated" in r]
    lines += [
        f"- full cache: first answer token's logits differ by at most {logit:.2e} (largest "
        f"logit >= {scale:.1f}); same first token in {same} of {len(records)} samples; same "
        f"full-cache answers in {full} of {n_full}",
        f"- kvpress's compressed caches equal to a real `with press(model)` prefill's (first "
        f"sample, every ratio): {valid}",
    ]
    for ratio in compressions:
        cells = [r["settings"][str(ratio)] for r in records]
        jac = np.array([c["jaccard"] for c in cells])
        rule = np.array([c["jaccard_kvfn_scores_kvpress_pooling"] for c in cells])
        kept = sum(c["budget"] * jac.shape[1] * jac.shape[2] for c in cells)
        differ = sum(c["rows_differing"] for c in cells)
        edge = sum(c["rows_differing_at_boundary"] for c in cells)
        lines += [
            f"- ratio {ratio}: rows kept by one side only {differ} of {kept} kept "
            f"({100 * differ / kept:.4f}%); {edge} of them within the kernel's reach of the window, "
            f"most others the marginal rows they displace (kvpress's score within "
            f"{100 * max(c['inner_gap_to_cut'] for c in cells):.2f}% of its own cut); lowest "
            f"Jaccard of one (sample, layer, head) {jac.min():.4f}; with kvpress's pooling "
            f"applied to kvfn's own window scores the kept sets match at Jaccard "
            f"{rule.mean():.6f} (lowest {rule.min():.4f}: near-ties)",
            f"  scores: kvfn's row scores / 64 against kvpress's, relative to the layer's largest: "
            f"at most {max(max(c['score_rel_diff']) for c in cells):.1e} away from the window, "
            f"median {np.median([c['score_rel_diff_edge'] for c in cells]):.2f} on the 2 rows "
            f"before it",
        ]
    return "\n".join(lines)


def timings(records: list) -> str:
    keys = sorted({k for r in records for k in r["timing"]})
    rows = [f"| {k} | {np.mean([r['timing'][k] for r in records if k in r['timing']]):.1f} |"
            for k in keys]  # fmt: skip
    return "\n".join(["| step | mean seconds a sample |", "|---|---|", *rows])


def command_of(config: dict) -> str:
    words = ["python", "examples/compare_kvpress.py"]
    for key in ("samples", "tasks", "length", "compression", "kvpress_commit", "out"):
        value = config.get(key)
        if value is not None:
            value = value if isinstance(value, list) else [value]
            words += [f"--{key.replace('_', '-')}", *map(str, value)]
    return " ".join(words)


def write(args, records, env, seconds) -> str:
    config = {k: v for k, v in vars(args).items() if k != "report"}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = table(records, args.compression) if records else "(no samples yet)"
    Path(f"{out}.json").write_text(json.dumps(
        dict(config=config, environment=env, seconds=seconds, table=text, records=records),
        indent=1))  # fmt: skip
    report(config, env, seconds, records, text, out)
    return text


def report(config, env, seconds, records, text, out) -> None:
    env_lines = "\n".join(f"- {k}: {v}" for k, v in env.items())
    parts = [
        "# kvfn SnapKV against kvpress SnapKVPress (same model, prompts, budget)",
        f"Qwen2.5-Coder-0.5B-Instruct (GGUF Q5_0, both dequantized to float32, CPU), "
        f"kvfn's RULER-style tasks at {config['length']} tokens, query-agnostic (kvpress's "
        f"protocol: the context compressed before the question). Accuracy in % of answers "
        f"(`match_all`); 'same answer': the two answer strings are identical; Jaccard: of the "
        f"kept prompt positions, per layer and KV head, averaged (min layer: the layer of the "
        f"lowest mean); 'mid': without the window rows both keep.",
        text,
        f"```bash\n{command_of(config)}\n```",
        diagnostics(records, config["compression"]) if records else "",
        settings_table(),
        f"Timings (seconds; total {seconds:.0f}, 2 shared CPU cores):\n\n{timings(records)}",
        f"Environment:\n\n{env_lines}",
    ]
    Path(f"{out}.md").write_text("\n\n".join(p for p in parts if p) + "\n")


def main(argv=None) -> dict:
    args = parse(argv)
    if args.report:
        run = json.loads(Path(args.report).read_text())
        text = table(run["records"], run["config"]["compression"])
        out = Path(args.report).with_suffix("")
        report(run["config"], run["environment"], run["seconds"], run["records"], text, out)
        print(text)
        return run
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    model, tok = kvfn_models.load(args.model)  # float32 on the CPU (dequantized)
    path = Path(args.model) if args.model.endswith(".gguf") else kvfn_models.model_path(args.model)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32).eval()  # fmt: skip
    pipe = KVPressTextGenerationPipeline(model=hf, tokenizer=tok._tokenizer)
    eos = set(tok.eos_token_ids) | {tok.eos_token_id}
    stops = hf.generation_config.eos_token_id
    stops = set(stops if isinstance(stops, list) else [stops])
    if stops != eos:
        print(f"note: kvpress stops at {sorted(stops)}, kvfn at {sorted(eos)}", flush=True)
    fm = kvfn.FunctionalModel(model)
    env = versions(args)
    env.update(attn_implementation=hf.config._attn_implementation, eos_kvpress=sorted(stops),
               eos_kvfn=sorted(eos), load_seconds=time.perf_counter() - t_start)  # fmt: skip
    print(json.dumps(env), flush=True)
    count = token_counter(tok)
    records = []
    for i in range(args.samples):  # tasks interleaved: a cut-short run stays balanced
        for task in args.tasks:
            sample = tasks.generate(task, seed=args.seed * 10_000 + i, target_tokens=args.length,
                                    count_tokens=count, n_questions=args.questions)  # fmt: skip
            t0 = time.perf_counter()
            r = run_sample(args, sample, tok, fm, hf, pipe, eos,
                           check=not args.no_validate and not records)  # fmt: skip
            r["timing"]["sample"] = time.perf_counter() - t0
            records.append(r)
            s = {k: (v["kvpress"], v["kvfn"], round(float(np.mean(v["jaccard"])), 4))
                 for k, v in r["settings"].items()}  # fmt: skip
            print(f"{task} #{i} P={r['context_tokens']} logit diff {r['logit_max_abs_diff']:.2e}"
                  f" full {r['full']['kvpress']} / {r['full']['kvfn']} {s} "
                  f"({r['timing']['sample']:.0f}s)", flush=True)  # fmt: skip
            write(args, records, env, time.perf_counter() - t_start)
    text = write(args, records, env, time.perf_counter() - t_start)
    print(text)
    return dict(records=records, table=text)


if __name__ == "__main__":
    main()
