"""On-policy distillation's parts (docs/algorithms.md): the advantage against numbers worked
by hand, the direction of a step on a two-token policy, the teacher's log-probs the explorer
records, and the trainer's refusal of rollouts without them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rft_hpc.algorithms.advantages import AdvantageBatch
from rft_hpc.algorithms.policy_losses import PolicyLossInputs
from rft_hpc.algorithms.registry import compute_advantages, compute_policy_loss
from rft_hpc.batch.logprobs import token_logprobs
from rft_hpc.batch.tokens import collate
from rft_hpc.buffer.records import Experience
from rft_hpc.core.errors import UserError
from rft_hpc.engines.teacher import HFTeacher, reverse_kl
from rft_hpc.trainer.prepare import teacher_logprobs

# two rollouts of one task, two trained tokens and a pad; rewards 1 and 0
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
STUDENT = torch.tensor([[-1.5, -1.0, 0.0], [-0.2, -2.0, -0.7]])
TEACHER = torch.tensor([[-1.0, -2.0, 0.0], [-0.2, -0.5, -1.7]])


def _batch(**fields) -> AdvantageBatch:
    return AdvantageBatch(rewards=torch.tensor([1.0, 0.0]), mask=MASK,
                          group_ids=torch.tensor([7, 7]), teacher_logprobs=TEACHER,
                          logprobs=STUDENT, **fields)


def test_each_tokens_advantage_is_the_teachers_log_prob_minus_the_students():
    adv, returns = compute_advantages("on_policy_distill", _batch())
    # teacher - student on trained tokens: 0.5, -1.0 | 0.0, 1.5, -1.0; 0 on the pad
    expected = [[0.5, -1.0, 0.0], [0.0, 1.5, -1.0]]
    assert torch.allclose(adv, torch.tensor(expected)) and torch.equal(adv, returns)
    half, _ = compute_advantages("on_policy_distill", _batch(), kl_coef=0.5)
    assert torch.allclose(half, 0.5 * torch.tensor(expected))


def test_a_reward_weight_adds_grpos_advantage_on_every_trained_token():
    # GRPO of rewards 1, 0 in one group: mean 0.5, population std 0.5 -> +1, -1
    adv, _ = compute_advantages("on_policy_distill", _batch(), reward_weight=0.25,
                                epsilon=0.0)
    expected = [[0.5 + 0.25, -1.0 + 0.25, 0.0], [0.0 - 0.25, 1.5 - 0.25, -1.0 - 0.25]]
    assert torch.allclose(adv, torch.tensor(expected))


def test_without_teacher_log_probs_the_advantage_says_what_it_needs():
    with pytest.raises(ValueError, match="teacher's and the rollout policy's log-prob"):
        compute_advantages("on_policy_distill", AdvantageBatch(rewards=torch.ones(2),
                                                                mask=MASK))


def test_a_distillation_step_moves_a_two_token_student_toward_its_teacher():
    """A student over two tokens (logits theta, p = 0.5 each), a teacher with p(token 0) =
    0.9: both tokens sampled, each advantage log p_T - log p_S, PPO's loss at ratio 1. One
    gradient step raises p(token 0) and lowers the reverse KL to the teacher."""
    theta = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    teacher = torch.log(torch.tensor([0.9, 0.1], dtype=torch.float64))

    def kl(logits: torch.Tensor) -> float:
        p = torch.softmax(logits, -1)
        return float((p * (torch.log(p) - teacher)).sum())

    logp = torch.log_softmax(theta, -1)[:, None]  # rollouts of token 0 and of token 1
    mask = torch.ones(2, 1, dtype=torch.float64)
    adv, _ = compute_advantages("on_policy_distill", AdvantageBatch(
        rewards=torch.zeros(2), mask=mask, teacher_logprobs=teacher[:, None],
        logprobs=logp.detach()))
    loss, _ = compute_policy_loss("ppo", PolicyLossInputs(
        logp=logp, mask=mask, old_logp=logp.detach(), advantages=adv.to(torch.float64)))
    loss.backward()
    with torch.no_grad():
        after = theta - 0.5 * theta.grad
    assert float(torch.softmax(after, -1)[0]) > 0.5 and kl(after) < kl(theta.detach())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoTokenizer

    from rft_hpc.models.tiny import init_tiny_model

    folder = tmp_path_factory.mktemp("teacher")
    init_tiny_model(folder)
    return folder, AutoTokenizer.from_pretrained(folder, local_files_only=True)


def _rollouts(tokenizer) -> list[Experience]:
    out = []
    for text, prompt in (("12+30=42", 6), ("7+8=15\n", 4), ("1+1=2", 4)):
        ids = tokenizer(text)["input_ids"]
        out.append(Experience(ids, prompt, logprobs=-np.ones(len(ids)), reward=1.0))
    return out


def test_the_teacher_scores_each_response_token_as_a_direct_forward(tiny):
    from transformers import AutoModelForCausalLM

    folder, tokenizer = tiny
    records = _rollouts(tokenizer)
    teacher = HFTeacher(folder, vocab=tokenizer.get_vocab(), temperature=0.7, batch_size=2)
    teacher.score(records)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    with torch.no_grad():
        direct = token_logprobs(model, collate(records, pad_id=0), 0.7)
    for i, r in enumerate(records):
        n, p = len(r.tokens), r.prompt_length
        assert np.all(r.teacher_logprobs[:p] == 0.0)  # the prompt is not scored
        assert np.allclose(r.teacher_logprobs[p:], direct[i, p - 1:n - 1].numpy(), atol=1e-5)
    gaps = np.concatenate([(r.logprobs - r.teacher_logprobs)[r.prompt_length:]
                           for r in records])
    assert reverse_kl(records) == pytest.approx(float(gaps.mean()), rel=1e-6)


def test_a_teacher_with_another_vocabulary_is_refused(tiny):
    folder, tokenizer = tiny
    with pytest.raises(UserError, match="another tokenizer than the policy"):
        HFTeacher(folder, vocab={**tokenizer.get_vocab(), "<extra>": 10_000})


def test_the_trainer_refuses_distillation_on_rollouts_without_teacher_log_probs(tiny):
    _, tokenizer = tiny
    records = _rollouts(tokenizer)
    records[0].teacher_logprobs = np.full(len(records[0].tokens), -0.5, np.float32)
    rows = teacher_logprobs(records[:1], 9, "on_policy_distill")
    assert rows.shape == (1, 9) and torch.all(rows[0, :len(records[0].tokens) - 1] == -0.5)
    assert torch.count_nonzero(teacher_logprobs(records, 9, "grpo")[1:]) == 0
    with pytest.raises(UserError, match="without them"):
        teacher_logprobs(records, 9, "on_policy_distill")


def test_the_config_refuses_a_teacher_that_cannot_be_one_at_its_key(tmp_path, tiny):
    from rft_hpc.config import load_config
    from rft_hpc.config.errors import ConfigError
    from rft_hpc.tasks.preflight import PREFLIGHT_CHECKS

    def problems(algorithm: str, workflow: str = "") -> list[str]:
        config = tmp_path / "exp.yaml"
        config.write_text(f"run: {{name: r}}\nalgorithm:\n{algorithm}\n{workflow}")
        with pytest.raises(ConfigError) as info:
            load_config(config, checks=PREFLIGHT_CHECKS)
        return [str(p) for p in info.value.problems]

    config = tmp_path / "exp.yaml"
    assert problems("  algorithm_type: on_policy_distill") == [
        f"{config}:2: algorithm: on_policy_distill learns from a teacher: set "
        "algorithm.teacher_model to the teacher's model folder"]
    assert problems(f"  algorithm_type: on_policy_distill\n  teacher_model: {tmp_path}/no") \
        == [f"{config}:4: algorithm.teacher_model: teacher folder '{tmp_path}/no' does not "
            "exist"]
    (multi,) = problems(f"  algorithm_type: on_policy_distill\n  teacher_model: {tiny[0]}",
                        "explorer:\n  workflow: {type: multi_turn, env: "
                        "guess}\n")
    assert multi.startswith(f"{config}:6: explorer.workflow.type: a teacher scores")
