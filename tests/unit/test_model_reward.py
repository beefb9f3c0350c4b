"""Reward models as rewards, with real tiny models built here (no mocks): `ModelScorer`'s
scores are a plain transformers forward of the same texts, one at a time; normalisation
per batch and running; batches of at most `batch_size`; a forward that raises scores its
calls 0 with the error; `RewardMix` sums a function (in a real worker process) and a model
with their weights, and fails a call whose term fails."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.reward_models import BROKEN_TOKEN, broken_reward_model, reward_model
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rft_hpc.config.rewards import RewardModelSpec, RewardSpec
from rft_hpc.explorer.protocols import Scorer
from rft_hpc.tasks.model_reward import ModelScorer, RunningMoments, model_text
from rft_hpc.tasks.reward_mix import RewardMix, score_in_process
from rft_hpc.tasks.reward_pool import RewardPool
from rft_hpc.tasks.task import Task

RESPONSES = ["4", "It is four, I think.", "22", "", "2+2 is 4 because two and two make four"]


@pytest.fixture(scope="module")
def chat_rm(tmp_path_factory):
    """A tiny Qwen2 reward model (chat template, byte-level tokenizer)."""
    return reward_model(tmp_path_factory.mktemp("rm") / "qwen2-rm")


@pytest.fixture(scope="module")
def plain_rm(tmp_path_factory):
    """A tiny character-level Llama reward model (no chat template)."""
    return reward_model(tmp_path_factory.mktemp("rm") / "llama-rm", "llama")


def calls_for(spec, prompt="What is 2+2?", responses=RESPONSES):
    task = Task("t-0", prompt, "4", reward_terms=(spec,))
    return [(task, r) for r in responses]


def direct_scores(folder, calls):
    """Each call scored alone (no padding) by a plain transformers forward."""
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(str(folder),
                                                               local_files_only=True)
    model.eval()
    out = []
    for task, response in calls:
        if tokenizer.chat_template:
            # the prompt as the policy reads it, the response, the end-of-turn token
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": task.prompt}], tokenize=False,
                add_generation_prompt=True) + response + "<|im_end|>"
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        else:
            ids = tokenizer(task.prompt + response, return_tensors="pt")
        with torch.inference_mode():
            out.append(float(model(**ids).logits[0, 0]))
    return out


@pytest.mark.parametrize("which", ["chat_rm", "plain_rm"])
def test_scores_equal_a_direct_forward_of_the_same_texts(which, request):
    folder = request.getfixturevalue(which)
    prompt = "What is 2+2?" if which == "chat_rm" else "2+2="
    responses = RESPONSES if which == "chat_rm" else ["4", "22", "5-1", "", "44444, 4"]
    calls = calls_for(RewardModelSpec(model=folder), prompt, responses)
    outcomes = ModelScorer().score(calls)
    assert not any(o.failed for o in outcomes), outcomes
    expected = direct_scores(folder, calls)
    assert [o.score for o in outcomes] == pytest.approx(expected, abs=1e-5)
    assert len(set(expected)) == len(expected)  # the texts do tell apart


def test_the_chat_template_renders_prompt_and_response(chat_rm):
    tokenizer = AutoTokenizer.from_pretrained(str(chat_rm), local_files_only=True)
    text = model_text(tokenizer, Task("t", "What is 2+2?", "4"), "four")
    assert "What is 2+2?" in text and "four" in text and text.index("2+2") < text.index("four")
    chat = Task("t", messages=[{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Hi?"}])
    assert "Be brief." in model_text(tokenizer, chat, "Hello")


def test_batch_normalisation_is_a_z_score_over_each_forward_batch(chat_rm):
    raw = [o.score for o in ModelScorer().score(calls_for(RewardModelSpec(model=chat_rm)))]
    spec = RewardModelSpec(model=chat_rm, normalize="batch", batch_size=3)
    scores = [o.score for o in ModelScorer().score(calls_for(spec))]
    first = torch.tensor(raw[:3], dtype=torch.float64)
    second = torch.tensor(raw[3:], dtype=torch.float64)
    expected = [*((first - first.mean()) / first.std(correction=0)).tolist(),
                *((second - second.mean()) / second.std(correction=0)).tolist()]
    assert scores == pytest.approx(expected, abs=1e-4)
    one = ModelScorer().score(calls_for(spec, responses=["4"]))
    assert one[0].score == 0.0  # a batch of one: nothing to compare it with


def test_running_normalisation_uses_every_score_so_far(chat_rm):
    raw = [o.score for o in ModelScorer().score(calls_for(RewardModelSpec(model=chat_rm)))]
    scorer = ModelScorer()
    spec = RewardModelSpec(model=chat_rm, normalize="running")
    first = scorer.score(calls_for(spec, responses=RESPONSES[:2]))
    second = scorer.score(calls_for(spec, responses=RESPONSES[2:]))
    seen = torch.tensor(raw, dtype=torch.float64)
    mean, std = float(seen.mean()), float(seen.std(correction=0))
    assert [o.score for o in second] == pytest.approx([(r - mean) / std for r in raw[2:]],
                                                      abs=1e-4)
    head = torch.tensor(raw[:2], dtype=torch.float64)
    assert [o.score for o in first] == pytest.approx(
        ((head - head.mean()) / head.std(correction=0)).tolist(), abs=1e-4)


def test_running_moments_match_the_moments_of_all_scores():
    moments = RunningMoments()
    scores = [0.5, -1.0, 2.0, 2.0, 7.25, 0.0, -3.5]
    for chunk in (scores[:1], scores[1:4], [], scores[4:]):
        moments.add(chunk)
    mean = sum(scores) / len(scores)
    assert moments.count == len(scores)
    assert moments.mean == pytest.approx(mean)
    assert moments.std == pytest.approx(math.sqrt(sum((s - mean) ** 2 for s in scores)
                                                  / len(scores)))


def test_a_forward_that_raises_scores_its_calls_zero_with_the_error(chat_rm, tmp_path):
    broken = broken_reward_model(tmp_path / "broken-rm", chat_rm)
    scorer = ModelScorer()
    spec = RewardModelSpec(model=broken)
    bad = scorer.submit(calls_for(spec, responses=["4", f"4 {BROKEN_TOKEN}"]))
    scorer.pump()
    assert [o.score for o in bad.result()] == [0.0, 0.0]
    assert all(o.failed and o.error.startswith("IndexError") for o in bad.result())
    good = scorer.score(calls_for(spec, responses=["4", "22"]))  # the next batch goes on
    assert not any(o.failed for o in good)
    assert [o.score for o in good] == pytest.approx(
        direct_scores(chat_rm, calls_for(spec, responses=["4", "22"])), abs=1e-5)


def test_a_model_that_fails_to_load_scores_zero_with_why(tmp_path):
    (tmp_path / "empty").mkdir()
    (outcome,) = ModelScorer().score(calls_for(RewardModelSpec(model=tmp_path / "empty"),
                                               responses=["4"]))
    assert outcome.failed and outcome.score == 0.0
    assert outcome.error.startswith(f"reward model {tmp_path / 'empty'} failed to load")


def test_the_mix_sums_a_function_and_a_model_with_their_weights(chat_rm):
    model = RewardModelSpec(model=chat_rm, weight=2.0)
    function = RewardSpec(name="exact_match", weight=0.5)
    mixed = Task("m", "What is 2+2?", "4", reward="0.5*exact_match + 2*model",
                 reward_terms=(function, model))
    plain = Task("p", "What is 2+2?", "4")  # one function: straight to the pool
    calls = [(mixed, "4"), (mixed, "22"), (plain, "4"), (plain, "5")]
    raw = direct_scores(chat_rm, [(mixed, "4"), (mixed, "22")])
    with RewardMix(RewardPool(workers=1, timeout=60.0)) as mix:
        assert isinstance(mix, Scorer) and isinstance(mix.scorers["model"], Scorer)
        outcomes = mix.score(calls)
        assert [o.score for o in outcomes] == pytest.approx(
            [0.5 + 2 * raw[0], 2 * raw[1], 1.0, 0.0], abs=1e-5)
        only_functions = mix.score([(plain, "4")])
        assert only_functions[0].score == 1.0


def test_a_failing_term_fails_the_whole_call(chat_rm, tmp_path, monkeypatch):
    (tmp_path / "failing_rewards.py").write_text(
        "def boom(task, response):\n    raise ValueError('no score for ' + response)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    broken = broken_reward_model(tmp_path / "broken-rm", chat_rm)
    task = Task("m", "What is 2+2?", "4", reward_terms=(
        RewardSpec(name="failing_rewards:boom"), RewardModelSpec(model=chat_rm)))
    model_only = Task("b", "What is 2+2?", "4", reward_terms=(RewardModelSpec(model=broken),))
    with RewardMix(RewardPool(workers=1, timeout=60.0)) as mix:
        raised, model_failed = mix.score([(task, "x"), (model_only, BROKEN_TOKEN)])
    assert raised.score == 0.0 and raised.error == \
        "failing_rewards:boom: ValueError: no score for x"
    assert model_failed.score == 0.0
    assert model_failed.error.startswith(f"model:{broken}: IndexError")


def test_in_process_scoring_sums_the_raw_terms(chat_rm):
    """Held-out evaluation's scoring: no workers, the model's score unnormalised."""
    task = Task("m", "What is 2+2?", "4", reward_terms=(
        RewardSpec(name="exact_match", weight=0.5),
        RewardModelSpec(model=chat_rm, weight=2.0, normalize="batch")))
    raw = direct_scores(chat_rm, [(task, "4")])[0]
    assert score_in_process(task, "4", {"model": ModelScorer()}) == pytest.approx(0.5 + 2 * raw,
                                                                       abs=1e-5)
    assert score_in_process(Task("p", "1+1=", "2"), "2", {"model": ModelScorer()}) == 1.0
