"""The optimizer's checkpointed state keyed by parameter names: one layout for every rank count.

`torch.optim.Optimizer.state_dict()` keys each parameter's state by its position in the
optimizer's parameter groups; `get_optimizer_state_dict` (what the FSDP backend gathers) keys
it by the parameter's name. A checkpoint holds the named form whatever the backend, so that
one saved by N ranks (ddp replicas, FSDP shards) is loaded by M ranks of either kind, one
process included (which trains with the ddp backend whatever `trainer.parallel` says)::

    {"state": {name: {"step", "exp_avg", "exp_avg_sq"}},
     "param_groups": [{"lr", "betas", ..., "params": [name, ...]}]}

The positional form (checkpoints written before this layout by a ddp or single-process
trainer) is still read: `to_named` converts it, the optimizer's parameters being the same
in the same order on every backend.
"""

from __future__ import annotations

from typing import Any

import torch


def is_named(state: dict[str, Any]) -> bool:
    """True when `state`'s parameters are named (not positions), or it names none."""
    params = [p for g in state.get("param_groups", []) for p in g["params"]]
    return all(isinstance(p, str) for p in params)


def _positions(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each of the optimizer's parameters, in the positions `state_dict` gives."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def to_named(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             state: dict[str, Any]) -> dict[str, Any]:
    """`state` (positional, as `optimizer.state_dict()` of `model`'s optimizer gives it, or
    already named) with every parameter under its name in `model`."""
    if is_named(state):
        return state
    names = _positions(model, optimizer)
    return {"state": {names[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                             for g in state["param_groups"]]}


def to_positional(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  state: dict[str, Any]) -> dict[str, Any]:
    """A named `state` in the positional form `optimizer.load_state_dict` takes. Raises
    `ValueError` when it names other parameters than the optimizer's."""
    if not is_named(state):
        return state
    index = {name: i for i, name in enumerate(_positions(model, optimizer))}
    saved = [p for g in state["param_groups"] for p in g["params"]]
    if sorted(saved) != sorted(index):
        raise ValueError(f"the saved optimizer state does not fit the model: it names "
                         f"{sorted(set(saved) - set(index))[:3]} and lacks "
                         f"{sorted(set(index) - set(saved))[:3]}")
    return {"state": {index[n]: s for n, s in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                             for g in state["param_groups"]]}


class NamedOptimizer:
    """A whole replica's optimizer as the checkpoint functions see it: `state_dict()` is
    the named state (module doc), `load_state_dict` takes a named or positional one."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state with its parameters named."""
        return to_named(self.model, self.optimizer, self.optimizer.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a state saved by any backend on any number of ranks."""
        self.optimizer.load_state_dict(to_positional(self.model, self.optimizer, state))
