"""The `math_verify` reward: is the response's final answer mathematically the reference's?

Built on the `math-verify` library: both sides are parsed into SymPy (`\\boxed{...}`, LaTeX
such as `\\frac{1}{2}` or `\\sqrt{2}`, plain numbers and expressions, `1,600` as 1600) and
compared numerically and symbolically, so `0.5`, `1/2` and `$\\frac{1}{2}$` agree.

The reference (the task's `answer`) may be written as
- GSM8K does: a worked solution ending in `#### 42` (what follows the last `####`);
- MATH does: a solution with the answer in `\\boxed{...}`;
- a plain value: `42`, `\\frac{3}{4}`, `$x^2+1$`.

math-verify's own time limits use SIGALRM, which works only in a process's main thread;
they are turned off here, and the caller bounds the time (the explorer's reward workers
kill a call that overruns `explorer.reward_timeout`).
"""

from __future__ import annotations

import logging
import re
from functools import lru_cache
from typing import Any

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from rft_hpc.tasks.task import Task

_EXTRACT = (LatexExtractionConfig(), ExprExtractionConfig())


class _NoTimeoutNotice(logging.Filter):
    """Drops math-verify's warning that its own timeouts are off (they are, on purpose)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_NoTimeoutNotice())


def reference_text(answer: str) -> str:
    """The part of a reference that holds the answer: what follows the last `####`
    (GSM8K), else the whole text (a boxed solution or a plain value)."""
    _, sep, tail = answer.rpartition("####")
    return tail.strip() if sep else answer.strip()


@lru_cache(maxsize=4096)
def parse_reference(answer: str) -> tuple[Any, ...]:
    """The parsed reference (cached: the rollouts of a group share it); empty when nothing
    in it parses. A bare LaTeX value (`\\frac12`) is parsed as if written `$\\frac12$`."""
    text = reference_text(answer)
    parsed = parse(text, extraction_config=_EXTRACT, parsing_timeout=None)
    if not parsed:
        parsed = parse(f"${text}$", extraction_config=_EXTRACT, parsing_timeout=None)
    return tuple(parsed)


def tagged(response: str, tag: str) -> str | None:
    """The content of the last `<tag>...</tag>` in `response`, None when there is none."""
    found = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", response, re.DOTALL)
    return found[-1] if found else None


def math_verify(task: Task, response: str, *, answer_tag: str | None = "answer",
                require_tag: bool = False, float_rounding: int = 6,
                strict: bool = True) -> float:
    """1.0 when the response's answer equals the task's reference answer, else 0.0.

    `answer_tag`: when the response holds `<answer>...</answer>` (this tag), only the last
    such content is read; None reads the whole response. `require_tag`: a response without
    the tag scores 0. `float_rounding`: decimal places floats are rounded to before they
    are compared. `strict`: variables must match by name and sets are not tuples (False:
    math-verify's lenient comparison). A reference that does not parse scores 0 for every
    response.
    """
    if answer_tag is not None:
        inner = tagged(response, answer_tag)
        if inner is None and require_tag:
            return 0.0
        response = inner if inner is not None else response
    gold = parse_reference(task.answer)
    if not gold:
        return 0.0
    answer = parse(response, extraction_config=_EXTRACT, parsing_timeout=None)
    if not answer:
        return 0.0
    return float(verify(list(gold), answer, float_rounding=float_rounding, strict=strict,
                        timeout_seconds=None))
