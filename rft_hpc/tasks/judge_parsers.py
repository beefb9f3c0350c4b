"""The built-in parsers of an LLM judge's answer (`BUILTIN_PARSERS`): each turns the judge's
answer text into a score, or None when the answer does not say one (the rollout then fails,
counted as `judge_unparseable`: `tasks.judge_reward`).

A parser is called as `parser(answer, **parser_args)`; a user's own parser
(`package.module:function`) is called the same way and keeps the same promise: a number
(a bool counts) or None, and a `ValueError` counts as None.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")

VERDICTS: dict[str, float] = {
    "yes": 1.0, "no": 0.0, "correct": 1.0, "incorrect": 0.0, "true": 1.0, "false": 0.0,
    "pass": 1.0, "fail": 0.0, "good": 1.0, "bad": 0.0, "accept": 1.0, "reject": 0.0,
}
"""The words `verdict` reads, and their scores."""


def number(answer: str, range: Sequence[float] | None = None,  # the config key's name
           pattern: str | None = None) -> float | None:
    """The first number in `answer` (`7`, `-2`, `8.5`, `.5`), or with `pattern` the first
    group of the regular expression's first match read as a number; clamped into
    `range` `[lo, hi]` when given. None when there is no number."""
    if pattern is not None:
        found = re.search(pattern, answer)
        text = (found.group(1) if found.groups() else found.group(0)) if found else None
        whole = _NUMBER.fullmatch(text.strip()) if text is not None else None
        if whole is None:
            return None
        value = float(whole.group(0))
    else:
        first = _NUMBER.search(answer)
        if first is None:
            return None
        value = float(first.group(0))
    if range is not None:
        lo, hi = range
        value = min(max(value, lo), hi)
    return value


def choice(answer: str, **labels: float) -> float | None:
    """The value of the label `answer` says first (whole words, any case: with
    `{yes: 1, no: 0}`, `"Yes."` is 1 and `"no, not yes"` is 0); None when it says none."""
    if not labels:
        raise ValueError("the choice parser needs labels and their values in parser_args, "
                         "e.g. {'yes': 1, 'no': 0}")
    words = "|".join(re.escape(k) for k in sorted(labels, key=len, reverse=True))
    found = re.search(rf"(?<!\w)({words})(?!\w)", answer, re.IGNORECASE)
    if found is None:
        return None
    by_case = {k.lower(): float(v) for k, v in labels.items()}
    return by_case[found.group(1).lower()]


def verdict(answer: str) -> float | None:
    """`choice` over `VERDICTS`: yes, correct, true, pass, good, accept are 1; no,
    incorrect, false, fail, bad, reject are 0; None when the answer says none of them."""
    return choice(answer, **VERDICTS)
