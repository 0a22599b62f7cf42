"""Which KV heads retrieve from the long context: training-free head profiling, written as a
DuoAttention pattern (``kvfn.HeadPattern``).

DuoAttention trains a gate per head; here a head is scored from its attention on probe prompts,
one forward pass each (``FunctionalModel.scored_forward`` keeps the probe queries' attention rows):

* ``retrieval`` (Wu et al., arXiv:2404.15574): while the model copies a needle from the
  context, a head scores when its most-attended key is the needle token being copied;
* ``mass``: the attention the copying queries put on the needle's rows (a smooth version);
* ``razor`` (RazorAttention, arXiv:2407.15891): on a random token sequence seen twice, the
  attention of the second copy on its earlier twin (echo) and the token after it (induction).

A KV head takes the max over its query heads (it must serve any of them). Scores lie in [0, 1].
"""

import argparse
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from .policies.duo import HeadPattern
from .serving.flags import non_negative_int, positive_int, seed
from .wrapper import FunctionalModel, QuerySlice

METHODS = ("retrieval", "mass", "razor")
MIN_LENGTH = 64  # probe prompt tokens
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    "A quiet town sat beside the river, and its people kept to their old routines. "
    "Every morning the baker opened his shop before dawn and the smell of bread filled the "
    "street. Children walked to school along the same path their parents had taken. "
)


def attention_rows(fm: FunctionalModel, tokens: Sequence[int], start: int, stop: int) -> list:
    """Per layer, the attention (n_heads, stop - start, T) of the queries at positions
    [start, stop) over all T tokens, in one eager forward pass (full attention layers; a
    sliding-window layer gives its rows too)."""
    T = len(tokens)
    if not 0 <= start < stop <= T:
        raise ValueError(f"query rows [{start}, {stop}) must lie within the {T} tokens")
    states = fm.init_states(1, T)
    scores = tuple(mx.zeros((1, h, stop - start, T), mx.float32) for h in fm.n_heads)
    _, _, rows = fm.scored_forward(mx.array([list(tokens)]), states, scores,
                                   QuerySlice(start, stop))  # fmt: skip
    mx.eval(rows)
    return [np.array(r[0]) for r in rows]


def copy_scores(rows: list, tokens: Sequence[int], needle: Sequence[int], copy_start: int,
                start: int) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """``retrieval`` and ``mass`` per (layer, query head) from attention ``rows`` whose first
    query is at ``start``: the queries at copy_start - 1 + j predict the copy of the needle's
    j-th token (the needle's rows are ``needle``, its token ids ``tokens[needle]``)."""
    rows_of_needle = np.asarray(needle)
    queries = copy_start - 1 + np.arange(len(rows_of_needle)) - start
    want = np.asarray(tokens)[rows_of_needle]
    hit, mass = [], []
    for r in rows:  # (heads, w, T)
        q = r[:, queries, :]
        top = np.argmax(q, axis=-1)  # (heads, k)
        in_needle = np.isin(top, rows_of_needle)
        same = np.asarray(tokens)[top] == want[None, :]
        hit.append(np.mean(in_needle & same, axis=-1))
        mass.append(np.mean(q[:, :, rows_of_needle].sum(-1), axis=-1))
    return np.stack(hit), np.stack(mass)


def razor_scores(rows: list, length: int, start: int) -> np.ndarray:
    """Echo + induction attention per (layer, query head) for a sequence of ``length`` tokens
    repeated once, from ``rows`` whose first query is at ``start`` (in the second copy)."""
    out = []
    for r in rows:
        q = np.arange(start, start + r.shape[1])
        t = q - length  # the earlier twin's position
        ok = (t >= 0) & (t + 1 < length)
        w = np.arange(r.shape[1])[ok]
        echo = r[:, w, t[ok]]
        induction = r[:, w, t[ok] + 1]
        out.append(np.mean(echo + induction, axis=-1))
    return np.stack(out)


def to_kv_heads(scores: np.ndarray, n_kv_heads: Sequence[int]) -> np.ndarray:
    """(layers, query heads) -> (layers, KV heads): the max over each KV head's query heads."""
    return np.stack([s.reshape(h, -1).max(axis=1) for s, h in zip(scores, n_kv_heads)]).clip(
        0.0, 1.0
    )


def needle_probe(tokenizer, length: int, rng: np.random.Generator) -> tuple:
    """A context of about ``length`` tokens with a 7-digit needle, a request to repeat it, and
    the answer: (tokens, needle rows, first row of the copy)."""
    value = "".join(str(d) for d in rng.integers(0, 10, 7))
    head = tokenizer.encode(FILLER)
    body = []
    while len(body) < length:
        body += head
    cut = int(rng.integers(length // 10, length * 9 // 10))
    before = body[:cut]
    needle_text = f" The special magic number is {value}. "
    needle = tokenizer.encode(needle_text, add_special_tokens=False)
    digits = tokenizer.encode(value, add_special_tokens=False)
    ask = tokenizer.encode(" What is the special magic number? The special magic number is",
                           add_special_tokens=False)  # fmt: skip
    tokens = before + needle + body[cut:length] + ask + digits
    offset = _find(needle, digits)
    first = len(before) + offset
    return tokens, list(range(first, first + len(digits))), len(tokens) - len(digits)


def _find(seq: list, sub: list) -> int:
    for i in range(len(seq) - len(sub) + 1):
        if seq[i : i + len(sub)] == sub:
            return i
    raise ValueError("the needle's digits do not tokenize alike inside and outside the needle")


def profile_heads(model, tokenizer=None, *, method: str = "retrieval", length: int = 1024,
                  samples: int = 4, seed: int = 0, sink_size: int = 64,
                  recent_size: int = 256) -> HeadPattern:  # fmt: skip
    """A ``HeadPattern`` for ``model`` from ``samples`` probe prompts of about ``length`` tokens
    (``retrieval`` / ``mass`` need the ``tokenizer``; ``razor`` uses random token ids)."""
    if method not in METHODS:
        raise ValueError(f"unknown head profiling method {method!r} (choose from {METHODS})")
    if length < MIN_LENGTH or samples < 1:
        raise ValueError(
            f"need length >= {MIN_LENGTH} and samples >= 1, got {length} and {samples}"
        )
    if method != "razor" and tokenizer is None:
        raise ValueError(f"method {method!r} needs the model's tokenizer")
    fm = model if isinstance(model, FunctionalModel) else FunctionalModel(model)
    rng = np.random.default_rng(seed)
    total = None
    for _ in range(samples):
        s = _sample_scores(fm, tokenizer, method, length, rng)
        total = s if total is None else total + s
    scores = to_kv_heads(total / samples, fm.n_kv_heads)
    return HeadPattern(scores=scores, sink_size=sink_size, recent_size=recent_size)


def _sample_scores(fm, tokenizer, method, length, rng) -> np.ndarray:
    if method == "razor":
        vocab = getattr(getattr(fm.model, "args", None), "vocab_size", 1000)
        half = length // 2
        seq = rng.integers(0, min(vocab, 30000), half).tolist()
        tokens = seq + seq
        start = max(half + 1, len(tokens) - 128)  # the second copy's last queries
        return razor_scores(attention_rows(fm, tokens, start, len(tokens)), half, start)
    tokens, needle, copy_start = needle_probe(tokenizer, length, rng)
    start = copy_start - 1
    rows = attention_rows(fm, tokens, start, len(tokens) - 1)
    hit, mass = copy_scores(rows, tokens, needle, copy_start, start)
    return hit if method == "retrieval" else mass


def context_length(model) -> Optional[int]:
    """The model's trained context (``max_position_embeddings``), None where it gives none."""
    return getattr(getattr(model, "args", None), "max_position_embeddings", None)


def probe_length(text: str) -> int:
    value = int(text)
    if value < MIN_LENGTH:
        raise argparse.ArgumentTypeError(f"must be >= {MIN_LENGTH}, got {value}")
    return value


def check_out(out: Path) -> Optional[str]:
    """Why ``--out`` cannot become a folder (None if it can)."""
    existing = next(d for d in (out, *out.parents) if d.exists())
    if not existing.is_dir():
        return f"{existing} exists and is not a folder"
    return None


def main(argv: Optional[list] = None) -> None:
    """``kvfn heads``: profile a model's heads and write a DuoAttention pattern folder."""
    p = argparse.ArgumentParser(prog="kvfn heads", description=main.__doc__)
    p.add_argument("--model", help="a .gguf file, mlx-lm folder or kvfn_models name "
                   "(default: embedded SmolLM2)")  # fmt: skip
    p.add_argument("--method", choices=METHODS, default="mass")
    p.add_argument("--length", type=probe_length, default=1024, help="probe prompt tokens")
    p.add_argument("--samples", type=positive_int, default=4)
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--sink-size", type=non_negative_int, default=64)
    p.add_argument("--recent-size", type=positive_int, default=256)
    p.add_argument("--out", required=True, help="folder for full_attention_heads.tsv + config")
    args = p.parse_args(argv)
    problem = check_out(Path(args.out).absolute())
    if problem:
        p.error(f"argument --out: {problem}")
    import kvfn_models

    try:
        model, tokenizer = kvfn_models.load(args.model)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: --model: {e}")
    context = context_length(model)
    if context is not None and args.length > context:
        p.error(f"argument --length: {args.length} exceeds the model's context of {context} tokens")
    try:
        pattern = profile_heads(model, tokenizer, method=args.method, length=args.length,
                                samples=args.samples, seed=args.seed, sink_size=args.sink_size,
                                recent_size=args.recent_size)  # fmt: skip
    except ValueError as e:
        p.error(str(e))
    out = pattern.save(args.out, method=args.method, length=args.length, samples=args.samples,
                       seed=args.seed)  # fmt: skip
    print(f"wrote {out}: {pattern.shape[0]} layers x {pattern.shape[1]} KV heads ({args.method})")
