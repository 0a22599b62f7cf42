"""Answer scoring on hand-made cases."""

import pytest

from kvfn_eval.answers import match_all, match_any


def test_match_all_counts_the_references_found():
    assert match_all(" 1234567.", ["1234567"]) == 1.0
    assert match_all("They are: 111, 222 and 333.", ["111", "222", "333", "444"]) == 0.75
    assert match_all("nothing here", ["1234567"]) == 0.0


def test_matching_ignores_case_and_spacing_but_needs_whole_words():
    assert match_all("The words are APPLE,\n  Banana", ["apple", "banana"]) == 1.0
    assert match_all("11234567", ["1234567"]) == 0.0  # a longer number is not the answer
    assert match_all("12345678", ["1234567"]) == 0.0
    assert match_all("pineapple", ["apple"]) == 0.0
    assert match_all("VAR ABCDE, VAR XYZZY", ["abcde", "xyzzy"]) == 1.0
    assert match_all("long context", ["long  context"]) == 1.0


def test_match_any_is_one_if_any_reference_is_found():
    assert match_any("it was blue", ["red", "blue"]) == 1.0
    assert match_any("it was green", ["red", "blue"]) == 0.0


def test_no_references_is_an_error():
    with pytest.raises(ValueError, match="at least one reference"):
        match_all("x", [])
    with pytest.raises(ValueError, match="at least one reference"):
        match_any("x", [])
