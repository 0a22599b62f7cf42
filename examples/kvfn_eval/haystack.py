"""Haystack text for long-context tasks, all of it installed with the project (no download).

* ``filler_sentences``: RULER's repetitive noise, five short sentences cycled.
* ``book_sentences``: natural English prose, the King James Bible (public domain), one verse a
  unit, read as text from the ``pybible`` package's data module (never imported).
* ``vocabulary``: distinct plain words from that text, for keys and word-list tasks.
"""

import functools
import importlib.util
import re
from pathlib import Path

FILLER = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)

_VERSE = re.compile(r'^(?:Bible = \[)?"\d\d:\d\d\d:\d\d\d (.*)",?$')


def filler_sentences() -> tuple[str, ...]:
    return FILLER


def _bible_path() -> Path:
    spec = importlib.util.find_spec("pybible")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the natural-text haystack needs the `pybible` package: pip install 'kvfn[eval]'"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "Bible.py"


@functools.lru_cache(maxsize=1)
def book_sentences() -> tuple[str, ...]:
    """31,102 verses in book order, without their chapter:verse references."""
    verses = []
    with open(_bible_path(), encoding="utf-8") as f:
        for line in f:
            m = _VERSE.match(line.strip())
            if m:
                verses.append(m.group(1).replace('\\"', '"').strip())
    if len(verses) < 30000:
        raise RuntimeError(f"read only {len(verses)} verses from {_bible_path()}")
    return tuple(verses)


@functools.lru_cache(maxsize=1)
def vocabulary() -> tuple[str, ...]:
    """Sorted distinct lowercase words of 4-9 letters from the book text."""
    words = set()
    for verse in book_sentences():
        words.update(w for w in re.findall(r"\b[a-z]+\b", verse) if 4 <= len(w) <= 9)
    return tuple(sorted(words))
