"""Format rewards: does the response have the shape the prompt asked for?

`think_answer_format` scores the R1-style layout `<think>reasoning</think><answer>final
answer</answer>`. To add a format bonus to a correctness reward instead, use the pipeline's
`format_reward` shaper on top of it (docs/pipeline.md, docs/rewards.md).
"""

from __future__ import annotations

import re
from functools import lru_cache

from rft_hpc.tasks.task import Task


@lru_cache(maxsize=64)
def _layout(tags: tuple[str, ...]) -> re.Pattern[str]:
    blocks = (rf"<{re.escape(t)}>(.*?)</{re.escape(t)}>" for t in tags)
    return re.compile(r"\s*" + r"\s*".join(blocks) + r"\s*", re.DOTALL)


def think_answer_format(task: Task, response: str, *, think_tag: str | None = "think",
                        answer_tag: str = "answer") -> float:
    """1.0 when the response is exactly `<think>...</think>` followed by
    `<answer>...</answer>` (each once, neither empty, nothing around or between them but
    whitespace), else 0.0. `think_tag`/`answer_tag` rename the tags; `think_tag: null`
    asks for the answer block alone."""
    tags = (think_tag, answer_tag) if think_tag else (answer_tag,)
    found = _layout(tags).fullmatch(response)
    if found is None:
        return 0.0
    for tag, content in zip(tags, found.groups(), strict=True):
        if not content.strip() or f"<{tag}>" in content or f"</{tag}>" in content:
            return 0.0
    return 1.0
