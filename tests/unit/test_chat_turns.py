"""Multi-turn chat token by token (rft_hpc/tasks/chat_turns.py), per model family: a
conversation grown turn by turn from the policy's own tokens is the template's rendering of
the whole conversation when that rendering is stable, keeps sampled tokens as sampled when
they would tokenize otherwise, and keeps Qwen3's reasoning where a re-rendering drops it."""

from __future__ import annotations

import pytest
from helpers.chat_models import chat_model
from transformers import AutoTokenizer

from rft_hpc.tasks.chat_turns import PROBES, ChatTurns

FAMILIES = ["llama", "llama3", "qwen2", "qwen3", "mistral"]
TASK = [{"role": "user", "content": "What is 12+30?"}]
OBSERVATIONS = ["Too small.", "Right: 42."]


@pytest.fixture(scope="module", params=FAMILIES)
def tokenizer(request, tmp_path_factory):
    folder = chat_model(tmp_path_factory.mktemp(f"turns-{request.param}"), request.param)
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def render(tok, messages, generation: bool = True) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)


def ids(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def grow(tok, turns: ChatTurns, answers: list[list[int]]) -> list[int]:
    """The token sequence of TASK, then each answer (as sampled) and observation."""
    seq = ids(tok, render(tok, TASK))
    for answer, observation in zip(answers, OBSERVATIONS, strict=True):
        seq += answer + turns.close_turn(answer)
        seq += turns.messages([{"role": "user", "content": observation}])
    return seq


def test_turn_by_turn_equals_the_whole_conversation_rendered(tokenizer):
    tok = tokenizer
    turns = ChatTurns(tok)
    answers = ["40", "42"]
    sampled = [[*ids(tok, a), turns.end_of_turn] for a in answers]
    messages = list(TASK)
    for answer, observation in zip(answers, OBSERVATIONS, strict=True):
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": observation}]
    assert tok.decode(grow(tok, turns, sampled)) == render(tok, messages)
    assert grow(tok, turns, sampled) == ids(tok, render(tok, messages))


def test_a_turn_cut_short_is_closed_and_sampled_tokens_stay_as_sampled(tokenizer):
    tok = tokenizer
    turns = ChatTurns(tok)
    # "42" sampled one character at a time where the tokenizer may merge them: kept as is
    answer = [t for ch in "42" for t in ids(tok, ch)]
    seq = grow(tok, turns, [answer, answer])
    closed = [*answer, turns.end_of_turn, *turns.after_turn]
    start = len(ids(tok, render(tok, TASK)))
    assert seq[start:start + len(closed)] == closed
    assert turns.close_turn([*answer, turns.end_of_turn]) == turns.after_turn


def test_each_family_takes_the_probe_its_template_keeps_stable(tokenizer):
    turns = ChatTurns(tokenizer)
    qwen3 = "<think>" in (tokenizer.chat_template or "")
    assert turns.probe == (PROBES[1] if qwen3 else PROBES[0])


def test_qwen3_reasoning_stays_where_a_re_rendering_drops_it(tmp_path):
    tok = AutoTokenizer.from_pretrained(str(chat_model(tmp_path, "qwen3")),
                                        local_files_only=True)
    turns = ChatTurns(tok)
    answer = [*ids(tok, "<think>\n12+30\n</think>\n\n42"), turns.end_of_turn]
    seq = grow(tok, turns, [answer, answer])
    assert tok.decode(seq).count("<think>\n12+30\n</think>") == 2
    # rendered whole, the template keeps no reasoning before the last user message
    whole = render(tok, [*TASK, {"role": "assistant", "content": tok.decode(answer[:-1])},
                         {"role": "user", "content": OBSERVATIONS[0]}])
    assert "12+30\n</think>" not in whole
