"""The transformers engine's sampling (rft_hpc.engines.hf): each group samples from its own
seed, so the engine may batch requests however they arrive (several steps, dynamic
sampling's draws) and a group still gets the completions it gets alone; and the row sampler
draws from softmax(logits / T)."""

from __future__ import annotations

import pytest
import torch

from rft_hpc.engines.hf import HFEngine, RowSampler
from rft_hpc.engines.requests import GroupRequest
from rft_hpc.models.tiny import TinyModelSpec, init_tiny_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> HFEngine:
    return HFEngine(init_tiny_model(tmp_path_factory.mktemp("m") / "model",
                                    TinyModelSpec(arch="qwen2", num_layers=2)))


def _requests(tag: str, prompts: list[list[int]], seed0: int) -> list[GroupRequest]:
    return [GroupRequest((tag, i), p, 4, 8, 0.9, seed0 + 4 * i) for i, p in enumerate(prompts)]


def test_a_group_gets_the_same_completions_alone_and_in_any_batch(engine: HFEngine) -> None:
    mine = _requests("mine", [[5, 6, 7], [8, 9, 10, 11, 12]], 100)
    engine.submit(mine)
    alone = {g.key: g.completions for g in engine.poll()}
    # other groups before and after, longer prompts (another padding), another order
    engine.submit(_requests("before", [[20, 21, 22, 23, 24, 25, 26, 27]] * 3, 7))
    engine.submit(mine[::-1])
    engine.submit(_requests("after", [[30], [31, 32]], 55))
    assert engine.in_flight == 7
    batched = {g.key: g.completions for g in engine.poll()}
    assert engine.in_flight == 0 and len(batched) == 7
    for key, completions in alone.items():
        for a, b in zip(completions, batched[key], strict=True):
            assert a.tokens == b.tokens
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    # the four samples of a group differ (their seeds do), and other seeds give others
    assert len({tuple(c.tokens) for c in alone[("mine", 1)]}) > 1
    assert [c.tokens for c in alone[("mine", 0)]] != [c.tokens for c in batched[("before", 0)]]


def test_generate_draws_sample_k_of_prompt_i_with_seed_plus_i_n_plus_k(engine: HFEngine) -> None:
    prompts = [[5, 6, 7], [8, 9]]
    whole = engine.generate(prompts, n=3, max_new_tokens=6, temperature=1.0, seed=40)
    second = engine.generate(prompts[1:], n=3, max_new_tokens=6, temperature=1.0, seed=43)
    assert [c.tokens for c in whole[1]] == [c.tokens for c in second[0]]


def test_the_row_sampler_draws_from_the_tempered_softmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 10) * 2
    rows, temperature = 40_000, 0.7
    want = torch.softmax(logits / temperature, -1)[0]
    picks = RowSampler(range(rows), temperature)(None, logits.expand(rows, 10)).argmax(-1)
    freq = torch.bincount(picks, minlength=10).float() / rows
    sigma = (want * (1 - want) / rows).sqrt()
    assert ((freq - want).abs() <= 5 * sigma + 1e-4).all(), (freq, want)
