"""A lookup tool for agents (`prompt.tools: [rft_hpc.envs.codebook:lookup]`): the tool of the
`lookup` task (`rft_hpc.tasks.lookup`). Each account number has a code of three letters, a
hash of the number: a model cannot know the code of an account it never saw, but it can ask
the tool and copy its answer (docs/agents.md).

The docstring is the tool's description in every prompt (its JSON schema, rendered by the
chat template): kept short, since the tiny chat models see ~1024 tokens, one per byte."""

from __future__ import annotations

import hashlib

LETTERS = "DFGHJKPQXYZ"
"""The codes' letters: capitals that the prompts of the tool recipe (Mistral's template, the
tool's schema, the question) do not write, so that a code's letters are found nowhere else
in a trajectory: a tiny model learns to copy them sooner."""


def lookup(account: int) -> str:
    """Code of an account.

    Args:
        account: Its number.
    """
    digest = hashlib.sha256(f"rft-hpc codebook {int(account)}".encode()).digest()
    return LETTERS[int.from_bytes(digest[:8], "big") % len(LETTERS)]
