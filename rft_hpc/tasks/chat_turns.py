"""A multi-turn chat as token ids, token in and token out: the policy's sampled tokens are
kept as sampled, and each new message adds the chat template's rendering of that message
alone, so no earlier turn is ever re-tokenized (and rendered) differently.

Re-rendering the whole conversation each turn is not the same sequence: templates change
how earlier turns look once later ones exist (Qwen3 keeps an assistant turn's `<think>`
block only after the last user message), and text sampled as tokens need not tokenize back
to the same tokens. So a message's tokens are the difference between the rendering of a
fixed probe conversation with the message appended and without it, where the probe is one
whose rendering is a prefix of the longer one (checked, per template; docs/agents.md says
which probe each family takes):

- Qwen2 / Qwen2.5, Llama 3, Mistral: `[user, assistant]`;
- Qwen3: `[user, assistant, user]` (after `[user, assistant]` its assistant turn loses the
  empty think block it had as the last turn).

After the policy's turn (which ends with the end-of-turn token it sampled, or which the
engine cut at `max_new_tokens`) come the end-of-turn token when it was cut, and what the
template writes after it (ChatML's newline).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from rft_hpc.core.errors import UserError
from rft_hpc.tasks.prompts import end_of_turn_id

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = dict[str, str]

_USER, _ANSWER = "rft-hpc probe question", "rft-hpc probe answer"
PROBES: tuple[tuple[Message, ...], ...] = (
    ({"role": "user", "content": _USER}, {"role": "assistant", "content": _ANSWER}),
    ({"role": "user", "content": _USER}, {"role": "assistant", "content": _ANSWER},
     {"role": "user", "content": _USER}),
)
"""The probe conversations tried, in order: the first whose rendering stays a prefix."""


class ChatTurns:
    """The token ids a chat template gives each turn of a conversation, one turn at a time
    (the module docstring says how)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        end = end_of_turn_id(tokenizer)
        if end is None:
            raise UserError("multi-turn chat needs a chat template that ends an assistant "
                            "turn with a special token (<|im_end|>, <|eot_id|>, </s>, ...)")
        self.end_of_turn = end
        self.probe = self._probe()
        self._base = self._render(self.probe)  # every message's rendering starts after it
        answered = self._render(PROBES[0])
        tail = answered[answered.rfind(_ANSWER) + len(_ANSWER):]
        eot_text = tokenizer.decode([end])
        if not tail.startswith(eot_text):
            raise UserError("the chat template writes text between an assistant turn's "
                            f"content and its end-of-turn token: {tail!r}")
        self.after_turn = self._ids(tail[len(eot_text):])
        """What the template writes after an assistant turn's end-of-turn token."""

    def close_turn(self, sampled: Sequence[int]) -> list[int]:
        """The tokens that follow a policy turn `sampled`: its end-of-turn token when the
        engine cut it short, then `after_turn`. They are not the policy's (mask 0)."""
        cut = not sampled or sampled[-1] != self.end_of_turn
        return ([self.end_of_turn] if cut else []) + self.after_turn

    def messages(self, messages: Sequence[Message]) -> list[int]:
        """The template's rendering of `messages` (user or tool messages that follow a
        closed assistant turn) alone, with the generation prompt of the next assistant
        turn."""
        base = self._base
        full = self._render([*self.probe, *messages], add_generation_prompt=True)
        if not full.startswith(base):
            raise UserError("the chat template renders the earlier turns differently once "
                            f"these messages follow them: {list(messages)!r}")
        return self._ids(full[len(base):])

    def _probe(self) -> tuple[Message, ...]:
        observation = [{"role": "user", "content": "rft-hpc probe observation"}]
        for probe in PROBES:
            try:
                base = self._render(probe)
                longer = self._render([*probe, *observation], add_generation_prompt=True)
            except Exception:  # the template refuses this order of roles (Mistral's): the next
                continue
            if longer.startswith(base):
                return probe
        raise UserError("no probe conversation keeps this chat template's earlier turns "
                        "unchanged when a message follows: multi-turn chat cannot extend it "
                        "token by token")

    def _render(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
