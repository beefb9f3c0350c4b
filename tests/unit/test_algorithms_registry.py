"""Advantage functions and policy losses by name and by a user's import path."""

from __future__ import annotations

import sys

import pytest
import torch

from rft_hpc.algorithms import (
    ADVANTAGES,
    POLICY_LOSSES,
    AdvantageBatch,
    Advantages,
    PolicyLossInputs,
    compute_advantages,
    compute_policy_loss,
    gae,
    ppo_policy_loss,
    register_advantage,
    resolve_advantage,
    resolve_policy_loss,
)
from rft_hpc.core.errors import UserError

PLUGIN = '''
import torch
from rft_hpc.algorithms import Advantages

def constant(batch, value=1.0):
    adv = torch.where(batch.mask > 0, value, 0.0)
    return Advantages(adv, adv)

def squashed(batch):
    return Advantages(torch.zeros(3), torch.zeros(3))

def neg_logp_sum(inputs, scale=1.0):
    loss = -(inputs.logp * inputs.mask).sum() * scale
    return loss, {"scale": torch.tensor(scale)}

NOT_CALLABLE = 3
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "my_algos.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_algos"
    sys.modules.pop("my_algos", None)


def test_trinity_names_are_registered():
    assert resolve_advantage("ppo") is gae
    assert {"ppo", "grpo", "rloo", "reinforceplusplus", "opmd"} <= set(ADVANTAGES)
    assert resolve_policy_loss("ppo") is ppo_policy_loss
    assert set(POLICY_LOSSES) == {"ppo", "opmd", "sft", "dpo", "mix", "gspo", "cispo", "sapo",
                                  "clip_cov", "kl_cov", "simpo", "orpo", "kto"}


def test_plugins_by_import_path(plugin):
    batch = AdvantageBatch(rewards=torch.tensor([1.0, 0.0]), mask=torch.tensor([[0.0, 1.0],
                                                                                [1.0, 1.0]]))
    adv, returns = compute_advantages(f"{plugin}:constant", batch, value=2.5)
    assert adv.tolist() == [[0.0, 2.5], [2.5, 2.5]] and torch.equal(adv, returns)
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, metrics = compute_policy_loss(f"{plugin}:neg_logp_sum",
                                        PolicyLossInputs(logp, torch.tensor([[1.0, 0.0]])),
                                        scale=3.0)
    assert loss.item() == 3.0 and metrics["scale"].item() == 3.0
    with pytest.raises(ValueError, match=r"advantages of shape \(3,\), expected \(2, 2\)"):
        compute_advantages(f"{plugin}:squashed", batch)
    with pytest.raises(UserError, match="is not callable"):
        resolve_policy_loss(f"{plugin}:NOT_CALLABLE")


def test_unknown_names_list_the_known_ones():
    with pytest.raises(UserError, match="unknown policy loss 'ppo2'; registered: "
                                        "cispo, clip_cov, dpo, gspo, kl_cov, kto, mix, opmd, "
                                        "orpo, ppo, sapo, sft, simpo"):
        resolve_policy_loss("ppo2")
    with pytest.raises(UserError, match=r"unknown advantage function 'grp'; registered: .*grpo"):
        resolve_advantage("grp")
    with pytest.raises(UserError, match="advantage function 'no_such_module_xyz:f' cannot be "
                                        "imported"):
        resolve_advantage("no_such_module_xyz:f")
    with pytest.raises(UserError, match="cannot be imported"):
        resolve_advantage("rft_hpc.algorithms.advantages:no_such_function")


def test_register_advantage_decorator():
    @register_advantage("zeros_for_test")
    def zeros(batch: AdvantageBatch) -> Advantages:
        z = torch.zeros_like(batch.mask)
        return Advantages(z, z)

    try:
        assert resolve_advantage("zeros_for_test") is zeros
    finally:
        ADVANTAGES.pop("zeros_for_test")
    with pytest.raises(UserError):
        resolve_advantage("zeros_for_test")
