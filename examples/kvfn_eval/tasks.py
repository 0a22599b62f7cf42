"""RULER-style long-context tasks (arXiv:2404.06654), generated offline from a seed.

A ``Sample`` is an instruction, a context (haystack with needles) and one or more questions,
each with the strings a right answer contains. Every random choice (keys, values, depths, the
haystack's starting point) is drawn from the seed before the length is fitted, so a sample is a
pure function of (task, seed, target length, token counter). The context grows, unit by unit of
haystack, to the longest one whose longest prompt (as ``count_tokens`` measures it) fits.

Tasks: passkey; needle-in-a-haystack single, multi-key (every key asked in turn, the others
are distractors), multi-value, multi-query; variable tracking; common-words extraction.
"""

import random
from dataclasses import dataclass, replace
from typing import Callable

from . import haystack


@dataclass(frozen=True)
class Question:
    text: str
    answer_prefix: str  # begins the model's answer (RULER does the same)
    answers: tuple[str, ...]


@dataclass(frozen=True)
class Sample:
    task: str
    seed: int
    target_tokens: int
    instruction: str
    context: str
    questions: tuple[Question, ...]
    needles: tuple[tuple[int, int], ...]  # (start, stop) character span of each needle in context


@dataclass(frozen=True)
class _Spec:
    """What a task draws from its seed; ``render`` turns it into a context of n units."""

    instruction: str
    questions: tuple[Question, ...]
    needles: tuple[str, ...]
    depths: tuple[float, ...]  # where each needle goes, as a fraction of the haystack
    units: Callable[[int], list[str]]  # n -> n haystack units


NIAH_INSTRUCTION = (
    "A few special magic numbers are hidden in the text below. Memorize them: "
    "you will be asked about them afterwards.\n\n"
)
PASSKEY_INSTRUCTION = (
    "Some important information is hidden in a long stretch of irrelevant text. "
    "Find it and memorize it: you will be asked about it afterwards.\n\n"
)
VT_INSTRUCTION = (
    "Memorize and follow the chains of variable assignments hidden in the text below.\n\n"
)
CWE_INSTRUCTION = (
    "Below is a numbered list of words. Some words appear more often than others. "
    "Memorize the ones that appear most often.\n\n"
)


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _keys(rng: random.Random, n: int) -> list[str]:
    words = haystack.vocabulary()
    keys: list[str] = []
    while len(keys) < n:
        key = f"{rng.choice(words)}-{rng.choice(words)}"
        if key not in keys:
            keys.append(key)
    return keys


def _cycled(sentences: tuple[str, ...], start: int) -> Callable[[int], list[str]]:
    return lambda n: [sentences[(start + i) % len(sentences)] for i in range(n)]


def _book(rng: random.Random) -> Callable[[int], list[str]]:
    book = haystack.book_sentences()
    return _cycled(book, rng.randrange(len(book)))


def _filler() -> Callable[[int], list[str]]:
    return _cycled(haystack.filler_sentences(), 0)


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _ask_one(key: str, values: list[str]) -> Question:
    return Question(
        f"What is the special magic number for {key} mentioned in the provided text?",
        f"The special magic number for {key} mentioned in the provided text is",
        tuple(values),
    )


def passkey(rng: random.Random, target_tokens: int, n_questions: int) -> _Spec:
    value = _number(rng)
    return _Spec(
        PASSKEY_INSTRUCTION,
        (Question("What is the pass key?", "The pass key is", (value,)),),
        (f"The pass key is {value}. Remember it. {value} is the pass key.",),
        (rng.random(),),
        _filler(),
    )


def niah_single(rng: random.Random, target_tokens: int, n_questions: int) -> _Spec:
    (key,), value = _keys(rng, 1), _number(rng)
    return _Spec(NIAH_INSTRUCTION, (_ask_one(key, [value]),), (_needle(key, value),),
                 (rng.random(),), _book(rng))  # fmt: skip


def niah_multikey(rng: random.Random, target_tokens: int, n_questions: int) -> _Spec:
    keys = _keys(rng, n_questions)
    values = [_number(rng) for _ in keys]
    return _Spec(
        NIAH_INSTRUCTION,
        tuple(_ask_one(k, [v]) for k, v in zip(keys, values)),
        tuple(_needle(k, v) for k, v in zip(keys, values)),
        tuple(rng.random() for _ in keys),
        _book(rng),
    )


def niah_multivalue(rng: random.Random, target_tokens: int, n_questions: int) -> _Spec:
    (key,) = _keys(rng, 1)
    values = [_number(rng) for _ in range(4)]
    question = Question(
        f"What are all the special magic numbers for {key} mentioned in the provided text?",
        f"The special magic numbers for {key} mentioned in the provided text are",
        tuple(values),
    )
    return _Spec(NIAH_INSTRUCTION, (question,), tuple(_needle(key, v) for v in values),
                 tuple(rng.random() for _ in values), _book(rng))  # fmt: skip


def niah_multiquery(rng: random.Random, target_tokens: int, n_questions: int) -> _Spec:
    keys = _keys(rng, 4)
    values = [_number(rng) for _ in keys]
    listed = ", ".join(keys[:-1]) + f", and {keys[-1]}"
    question = Question(
        f"What are the special magic numbers for {listed} mentioned in the provided text?",
        f"The special magic numbers for {listed} mentioned in the provided text are",
        tuple(values),
    )
    return _Spec(NIAH_INSTRUCTION, (question,), tuple(_needle(k, v) for k, v in zip(keys, values)),
                 tuple(rng.random() for _ in keys), _book(rng))  # fmt: skip


def variable_tracking(rng: random.Random, target_tokens: int, n_questions: int) -> _Spec:
    hops, letters = 4, "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    names: list[str] = []
    while len(names) < n_questions * (hops + 1):
        name = "".join(rng.choice(letters) for _ in range(5))
        if name not in names:
            names.append(name)
    values = [str(rng.randint(10_000, 99_999)) for _ in range(n_questions)]
    needles, questions = [], []
    for c, value in enumerate(values):
        chain = names[c * (hops + 1) : (c + 1) * (hops + 1)]
        needles += [f"VAR {chain[0]} = {value}."]
        needles += [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])]
        questions.append(
            Question(
                f"Find all variables that are assigned the value {value} in the text above.",
                f"Answer: Following the chain of assignments in the text above, {hops + 1} "
                f"variables are assigned the value {value}. They are:",
                tuple(chain),
            )
        )
    # each chain's assignments in order; the chains interleave
    depths = [d for _ in values for d in sorted(rng.random() for _ in range(hops + 1))]
    return _Spec(VT_INSTRUCTION, tuple(questions), tuple(needles), tuple(depths), _filler())


def common_words(rng: random.Random, target_tokens: int, n_questions: int) -> _Spec:
    n_common, common_freq, rare_freq = 10, min(30, max(6, target_tokens // 250)), 3
    words = list(haystack.vocabulary())
    rng.shuffle(words)
    common, rare = words[:n_common], words[n_common:]
    common_part = [w for w in common for _ in range(common_freq)]
    shuffle_seed = rng.randrange(2**32)

    def units(n: int) -> list[str]:
        items = common_part + [w for w in rare[: max(n, 0)] for _ in range(rare_freq)]
        random.Random(shuffle_seed).shuffle(items)
        return [f"{i + 1}. {w}" for i, w in enumerate(items)]

    question = Question(
        f"What are the {n_common} most common words in the list above?",
        f"Answer: The {n_common} words that appear most often in the list are:",
        tuple(common),
    )
    return _Spec(CWE_INSTRUCTION, (question,), (), (), units)


TASKS: dict[str, Callable[[random.Random, int, int], _Spec]] = {
    "passkey": passkey,
    "niah_single": niah_single,
    "niah_multikey": niah_multikey,
    "niah_multivalue": niah_multivalue,
    "niah_multiquery": niah_multiquery,
    "variable_tracking": variable_tracking,
    "common_words": common_words,
}


def render(spec: _Spec, n: int) -> tuple[str, tuple[tuple[int, int], ...]]:
    """The context with n haystack units and every needle at its depth, and the needles' spans."""
    units = spec.units(n)
    slots: dict[int, list[int]] = {}
    for i, depth in enumerate(spec.depths):
        slots.setdefault(round(depth * len(units)), []).append(i)
    parts, spans, length = [], [None] * len(spec.needles), 0
    for u in range(len(units) + 1):
        for i in slots.get(u, []):
            spans[i] = (length, length + len(spec.needles[i]))
            parts.append(spec.needles[i])
            length += len(spec.needles[i]) + 1
        if u < len(units):
            parts.append(units[u])
            length += len(units[u]) + 1
    return " ".join(parts), tuple(spans)


def generate(
    task: str,
    *,
    seed: int,
    target_tokens: int,
    count_tokens: Callable[[Sample], int],
    n_questions: int = 4,
) -> Sample:
    """The sample of ``task`` for ``seed`` whose longest prompt is at most ``target_tokens``
    tokens, as ``count_tokens(sample)`` counts them (the caller's tokenizer and template)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    if target_tokens < 64:
        raise ValueError(f"target_tokens must be >= 64, got {target_tokens}")
    if n_questions < 1:
        raise ValueError(f"n_questions must be >= 1, got {n_questions}")
    spec = TASKS[task](random.Random(f"{task}:{seed}"), target_tokens, n_questions)
    base = Sample(task, seed, target_tokens, spec.instruction, "", spec.questions, ())

    def build(n: int) -> Sample:
        context, spans = render(spec, n)
        return replace(base, context=context, needles=spans)

    if count_tokens(build(0)) > target_tokens:
        raise ValueError(f"a {task} sample does not fit in {target_tokens} tokens")
    lo, hi = 0, 1
    while count_tokens(build(hi)) <= target_tokens:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # the largest n that fits lies in [lo, hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count_tokens(build(mid)) <= target_tokens else (lo, mid)
    return build(lo)
