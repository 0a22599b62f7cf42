"""RULER-style tasks: deterministic from the seed, sized to the target, answers where they belong."""

import re

import pytest

from kvfn_eval import haystack, tasks


def words(sample: tasks.Sample) -> int:
    """A cheap stand-in tokenizer: one token per whitespace-separated word."""
    return max(
        len((sample.instruction + sample.context + " " + q.text + " " + q.answer_prefix).split())
        for q in sample.questions
    )


@pytest.mark.parametrize("task", list(tasks.TASKS))
def test_same_seed_same_sample_other_seed_other_sample(task):
    a = tasks.generate(task, seed=3, target_tokens=600, count_tokens=words)
    b = tasks.generate(task, seed=3, target_tokens=600, count_tokens=words)
    c = tasks.generate(task, seed=4, target_tokens=600, count_tokens=words)
    assert a == b
    assert a.questions != c.questions


@pytest.mark.parametrize("task", list(tasks.TASKS))
@pytest.mark.parametrize("target", [300, 1500])
def test_sample_fills_but_does_not_pass_the_target(task, target):
    s = tasks.generate(task, seed=1, target_tokens=target, count_tokens=words)
    assert 0.85 * target <= words(s) <= target


@pytest.mark.parametrize("task", ["passkey", "niah_single", "niah_multikey", "niah_multivalue",
                                  "niah_multiquery"])  # fmt: skip
def test_each_number_is_in_its_needle_and_nowhere_else(task):
    s = tasks.generate(task, seed=7, target_tokens=1200, count_tokens=words, n_questions=3)
    values = sorted({a for q in s.questions for a in q.answers})
    assert len(s.needles) == {"passkey": 1, "niah_single": 1, "niah_multikey": 3}.get(task, 4)
    needle_text = [s.context[a:b] for a, b in s.needles]
    for value in values:
        inside = [t for t in needle_text if value in t]
        assert len(inside) == 1
        per_needle = 2 if task == "passkey" else 1
        assert len(re.findall(rf"(?<!\d){value}(?!\d)", s.context)) == per_needle
    for (a, b), text in zip(s.needles, needle_text):
        assert text.endswith(".") and (a == 0 or s.context[a - 1] == " ")


def test_needles_sit_at_their_depths_and_multikey_asks_every_key():
    s = tasks.generate("niah_multikey", seed=2, target_tokens=2000, count_tokens=words,
                       n_questions=4)  # fmt: skip
    assert len(s.questions) == 4
    for q, (a, b) in zip(s.questions, s.needles):
        key = q.text.split(" for ")[1].split(" mentioned")[0]
        assert f"for {key} is: {q.answers[0]}." in s.context[a:b]
    depths = [a / len(s.context) for a, _ in s.needles]
    assert len({round(d, 2) for d in depths}) == 4  # spread out, not stacked at one point


def test_variable_chains_are_assigned_in_order():
    s = tasks.generate("variable_tracking", seed=5, target_tokens=1500, count_tokens=words,
                       n_questions=2)  # fmt: skip
    for q in s.questions:
        value = q.text.split("value ")[1].split(" ")[0]
        first, *rest = q.answers
        at = s.context.index(f"VAR {first} = {value}.")
        for prev, name in zip(q.answers, rest):
            nxt = s.context.index(f"VAR {name} = VAR {prev}.")
            assert nxt > at
            at = nxt
        for name in q.answers:
            assert s.context.count(name) == (1 if name == q.answers[-1] else 2)


def test_common_words_are_the_most_frequent_items():
    s = tasks.generate("common_words", seed=0, target_tokens=2500, count_tokens=words)
    items = re.findall(r"\d+\. (\w+)", s.context)
    assert [int(n) for n in re.findall(r"(\d+)\. ", s.context)] == list(range(1, len(items) + 1))
    counts = {w: items.count(w) for w in set(items)}
    common = set(s.questions[0].answers)
    assert len(common) == 10
    assert min(counts[w] for w in common) > max(c for w, c in counts.items() if w not in common)


def test_book_haystack_is_natural_text_without_digits():
    book = haystack.book_sentences()
    assert len(book) > 30000 and book[0].startswith("In the beginning")
    s = tasks.generate("niah_single", seed=0, target_tokens=3000, count_tokens=words)
    a, b = s.needles[0]
    assert not re.search(r"\d", s.context[:a] + s.context[b:])


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        tasks.generate("nope", seed=0, target_tokens=500, count_tokens=words)
    with pytest.raises(ValueError, match="target_tokens must be >= 64, got 10"):
        tasks.generate("passkey", seed=0, target_tokens=10, count_tokens=words)
    with pytest.raises(ValueError, match="does not fit in 70 tokens"):
        tasks.generate("common_words", seed=0, target_tokens=70, count_tokens=words)
