"""How a RULER answer is graded: RULER's ``string_match_all`` under kvcli's whole-token rule."""

from __future__ import annotations

import re
from collections.abc import Sequence

from kvcli.eval.needle import is_correct


def found(answer: str, value: str) -> bool:
    """Whether ``answer`` writes ``value`` as a whole token: the one rule of every RULER score in kvcli.

    A number goes through the pass-key grader (:func:`kvcli.eval.needle.is_correct`: a whole number, "60494" never
    answers 6049). Anything else (a word, a hyphenated key, a uuid, a variable's name) must stand on its own,
    case aside as RULER lowercases: no letter, digit or hyphenated word may go on before or after it, so "Sun"
    answers "sun" but "sunny" or "sun-dial" do not.
    """
    if value.isdigit():
        return is_correct(answer, value)
    pattern = rf"(?<!\w)(?<!\w-){re.escape(value)}(?!\w)(?!-\w)"
    return re.search(pattern, answer, re.IGNORECASE) is not None


def recall(answer: str, outputs: Sequence[str]) -> float:
    """RULER's ``string_match_all`` for one answer: the share of ``outputs`` that :func:`found` finds in it."""
    if not outputs:
        raise ValueError("a sample expects at least one value")
    return sum(found(answer, value) for value in outputs) / len(outputs)
