"""A lookup tool for agents (`prompt.tools: [rft_hpc.envs.codebook:lookup]`): the tool of the
`lookup` task (`rft_hpc.tasks.lookup`). Each account number has a code, a letter drawn by a
hash of the number (`tasks.lookup.account_code`): a model cannot know the code of an account
it never saw (the best guess, the default code D, is right one time in three), but it can
ask the tool and copy its answer (docs/agents.md).

The docstring is the tool's description in every prompt (its JSON schema, rendered by the
chat template): kept short, since the tiny chat models see 1024 tokens."""

from __future__ import annotations

from rft_hpc.tasks.lookup import account_code


def lookup(account: int) -> str:
    """Code of an account.

    Args:
        account: Its number.
    """
    return account_code(int(account))
