"""Answer scoring, as RULER scores its tasks: does the prediction contain the reference strings.

Matching is case-insensitive on whitespace-normalized text, and a reference must stand as a whole
word or number ("1234567" is not found in "11234567"). ``match_all``: the fraction of the
references found (needles, variables, common words). ``match_any``: 1 if any is found.
"""

import re
from typing import Sequence

from typeguard import typechecked


def normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def contains(prediction: str, reference: str) -> bool:
    pattern = r"(?<!\w)" + re.escape(normalize(reference)) + r"(?!\w)"
    return re.search(pattern, normalize(prediction)) is not None


@typechecked
def match_all(prediction: str, references: Sequence[str]) -> float:
    if not references:
        raise ValueError("match_all needs at least one reference")
    return sum(contains(prediction, r) for r in references) / len(references)


@typechecked
def match_any(prediction: str, references: Sequence[str]) -> float:
    if not references:
        raise ValueError("match_any needs at least one reference")
    return float(any(contains(prediction, r) for r in references))
