"""A calculator tool for agents (`prompt.tools: [rft_hpc.envs.calculator:multiply]`): the
tool of the `products` task (`rft_hpc.tasks.products`), whose three-digit products a tiny
model cannot work out alone but can copy from the tool's answer (docs/agents.md).

The docstring is the tool's description in every prompt (its JSON schema, rendered by the
chat template): kept short, since the tiny chat models see ~1024 tokens, one per byte."""

from __future__ import annotations


def multiply(a: int, b: int) -> int:
    """Multiply.

    Args:
        a: A.
        b: B.
    """
    return int(a) * int(b)
