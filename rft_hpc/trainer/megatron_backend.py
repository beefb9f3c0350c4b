"""The Megatron-core backend of the trainer (`trainer.backend: megatron`): `MegatronBackend`.

The trainer's ranks form megatron-core's tensor-parallel groups (`parallel_state`); each rank
holds a `MegatronPolicy` (its GPTModel shard, HF-style forward: `rft_hpc.megatron.policy`),
built from the HF model folder (and the stage's start weights) by conversion and sharding.
Everything else of a step is the trainer loop's, as for the torch backend: rank 0 prepares
the batch and splits it over the data-parallel replicas (ranks // TP; megatron-core's rank
order puts a TP group on consecutive ranks), every rank of a TP group receives the same
rows and computes the same loss from the gathered logits, and the backward runs through
megatron-core's TP layers; with data parallelism the gradients are then summed over the
data-parallel group (the ranks with the same TP rank), as the torch backend sums them over
all ranks. What changes:

- the gradient norm for clipping is over the full model: TP-cut weights' squared norms are
  summed over the TP group, replicated ones (norms) counted once (`clip_grad_norm`);
- the full weights exist only when gathered (a collective, complete on rank 0): what is
  published and checkpointed is the full HF state dict, the same files as the torch backend;
- the checkpoint's optimizer state is AdamW's moments gathered the same way, keyed by HF
  parameter name (`MegatronState`), so a restore loads exact copies into each rank's shard.

The compute dtype is `model.dtype` (`auto`: bfloat16 on CUDA, else float32; weights and
AdamW state in it too): megatron-core's layers do not run under autocast, so
`trainer.dtype` must be `auto` or `model.dtype`.

Refused (`megatron_unsupported`): a LoRA adapter (`model.lora`), pipeline parallelism > 1,
a rank count that is not a multiple of `tensor_parallel`, a critic (PPO/GAE), a KL penalty
in the reward at TP > 1 (rank 0 would run the sharded reference alone).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rft_hpc.config import ExperimentConfig
from rft_hpc.core.errors import UserError
from rft_hpc.engines.hf import HFEngine, model_dtype
from rft_hpc.megatron.shards import tp_cut
from rft_hpc.trainer.algorithm import AlgorithmPlan
from rft_hpc.trainer.distributed import DistContext, all_reduce_gradients
from rft_hpc.trainer.fsdp import FullState
from rft_hpc.trainer.lora import lora_unsupported
from rft_hpc.trainer.torch_backend import idle_pass

if TYPE_CHECKING:  # megatron-core is an optional extra: imported where it is used
    from rft_hpc.megatron.policy import MegatronPolicy

_MOMENTS = ("exp_avg", "exp_avg_sq")


def megatron_unsupported(config: ExperimentConfig, world_size: int | None = None) -> str | None:
    """Why the Megatron backend cannot train `config` (on `world_size` ranks, when known):
    a sentence naming the setting, or None."""
    mcfg = config.trainer.megatron
    lora = lora_unsupported(config, sharded=True)
    if lora is not None:
        return lora
    if mcfg.pipeline_parallel > 1:
        return ("trainer.megatron.pipeline_parallel > 1 is not in the training loop yet "
                "(the weight layout and gather support it, see docs/megatron.md); use 1")
    tcfg, weights_dtype = config.trainer, config.model.dtype
    if tcfg.dtype not in ("auto", weights_dtype):
        return (f"trainer.dtype {tcfg.dtype} with model.dtype {weights_dtype}: "
                "trainer.backend megatron computes in the weights' dtype (megatron-core's "
                "layers do not run under autocast); set model.dtype to it, or trainer.dtype "
                "auto")
    plan = AlgorithmPlan.of(config)
    if plan.critic_lr is not None:
        return (f"algorithm {plan.type} trains a critic, which trainer.backend megatron does "
                "not have yet; use trainer.backend torch")
    if world_size is not None and world_size % mcfg.tensor_parallel:
        return (f"{world_size} trainer ranks do not split into tensor-parallel groups of "
                f"trainer.megatron.tensor_parallel = {mcfg.tensor_parallel}")
    if plan.kl_penalty is not None and mcfg.tensor_parallel > 1:
        return ("algorithm.kl_penalty_fn needs rank 0 to run the reference model alone, "
                "which tensor_parallel > 1 shards; use kl_loss_fn (a KL term in the loss)")
    return None


def setup_model_parallel(config: ExperimentConfig, ctx: DistContext) -> torch.device:
    """Initialise megatron-core for this rank (CPU shims without CUDA, a one-rank process
    group for a single process, `parallel_state` at the configured TP size, the model-
    parallel RNG on GPUs); returns the device the policy lives on. Raises `UserError` for a
    missing megatron-core or an unsupported setting."""
    from rft_hpc.megatron.runtime import megatron_problem

    problem = megatron_problem() or megatron_unsupported(config, ctx.world_size)
    if problem:
        raise UserError(f"trainer.backend megatron {problem}" if problem.startswith("needs")
                        else problem)
    from megatron.core import parallel_state as ps

    from rft_hpc.megatron.cpu import enable_cpu_execution

    cuda = torch.cuda.is_available()
    enable_cpu_execution()
    if cuda:
        device = torch.device("cuda", ctx.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():  # one process: megatron-core's groups need one anyway
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    tp = config.trainer.megatron.tensor_parallel
    if ps.model_parallel_is_initialized():
        if ps.get_tensor_model_parallel_world_size() == tp and \
                ps.get_pipeline_model_parallel_world_size() == 1:
            return device
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
    if cuda:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(config.run.seed)
    return device


def clip_grad_norm(policy: MegatronPolicy, max_norm: float) -> float:
    """Scale the gradients so the full model's gradient norm is at most `max_norm` (as
    `torch.nn.utils.clip_grad_norm_` on the whole model); returns the norm before. A
    collective of the TP group when TP > 1."""
    from megatron.core import parallel_state as ps

    grads = {name: p.grad for name, p in policy.gpt.named_parameters() if p.grad is not None}
    if not grads:
        return 0.0
    first = next(iter(grads.values()))
    cut = torch.zeros((), dtype=torch.float32, device=first.device)
    whole = torch.zeros_like(cut)
    for name, g in grads.items():
        sq = g.detach().float().pow(2).sum()
        if tp_cut(name) == "replicated":
            whole += sq
        else:
            cut += sq
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(cut, group=ps.get_tensor_model_parallel_group())
    total = float(torch.sqrt(cut + whole))
    coef = min(1.0, max_norm / (total + 1e-6))
    if coef < 1.0:
        for g in grads.values():
            g.mul_(coef)
    return total if math.isfinite(total) else float("nan")


def full_optimizer_state(policy: MegatronPolicy,
                         optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """AdamW's state with its moments gathered to full HF tensors, on global rank 0 (a
    collective; the other ranks get an empty dict): `{"state": {hf_name: {"exp_avg",
    "exp_avg_sq"}}, "step": float, "param_groups": [...] without "params"}`. Every weight
    takes part in every forward, so all share one AdamW step count."""
    params = dict(policy.gpt.named_parameters())
    state = optimizer.state
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for key in _MOMENTS:
        local = {name: state[p][key] if key in state.get(p, {}) else torch.zeros_like(p)
                 for name, p in params.items()}
        moments[key] = policy.hf_gather(local)
    steps = [float(s["step"]) for s in state.values() if "step" in s]
    if not moments[_MOMENTS[0]]:
        return {}
    names = moments[_MOMENTS[0]]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"state": {n: {key: moments[key][n] for key in _MOMENTS} for n in names},
            "step": max(steps, default=0.0), "param_groups": groups}


def load_optimizer_state(policy: MegatronPolicy, optimizer: torch.optim.Optimizer,
                         full: dict[str, Any]) -> None:
    """Load a state saved by `full_optimizer_state` into this rank's shard of it."""
    shards = {key: policy.shard_of({n: s[key] for n, s in full["state"].items()})
              for key in _MOMENTS}
    names = [name for name, _ in policy.gpt.named_parameters()]
    template = optimizer.state_dict()
    step = torch.tensor(float(full["step"]), dtype=torch.float32)
    template["state"] = {
        i: {"step": step.clone(), **{key: shards[key][name] for key in _MOMENTS}}
        for i, name in enumerate(names)} if full["step"] else {}
    for group, saved in zip(template["param_groups"], full["param_groups"], strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
    optimizer.load_state_dict(template)


class MegatronState(FullState):
    """The sharded policy (or its optimizer) as the checkpoint functions see a plain one:
    `state_dict()` is the full state gathered beforehand (rank 0 writes it), and
    `load_state_dict` takes a full state and keeps this rank's shard (every rank loads)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a full state: the model's HF weights, or the optimizer's when this views
        one."""
        if self.optimizer is None:
            self.model.load_hf(state)
        else:
            load_optimizer_state(self.model, self.optimizer, state)


class MegatronBackend:
    """This rank's `MegatronPolicy` (see the module doc); every rank drops the HF model
    once it has built its shard."""

    name = "megatron"
    sharded = True
    packs_prompts = False
    model: MegatronPolicy

    def __init__(self, config: ExperimentConfig, ctx: DistContext) -> None:
        self.config, self.dist = config, ctx
        self.device = setup_model_parallel(config, ctx)
        # megatron-core's layers do not run under autocast: the weights' dtype
        self.compute_dtype: torch.dtype = model_dtype(config.model.dtype, self.device)
        self.model_parallel = config.trainer.megatron.tensor_parallel
        self.rank0_forward = not ctx.distributed or self.model_parallel == 1

    def place(self, hf_model: torch.nn.Module) -> None:
        """Nothing: the HF model stays on the CPU until `build` converts it into the
        shard on this rank's device."""

    def build(self, engine: HFEngine, reference: bool) -> torch.nn.Module | None:
        """Every rank converts the same HF model into its shard (no broadcast); the
        reference is a second, frozen shard. Every rank then drops the HF model."""
        hf_model = engine.model
        self.model = self._policy(hf_model)
        self.model.train()
        ref = self._policy(hf_model, frozen=True) if reference else None
        engine.model = None  # its shard is all a rank trains (evaluation has its own model)
        return ref

    def _policy(self, hf_model: torch.nn.Module, frozen: bool = False) -> Any:
        """This rank's `MegatronPolicy` with `hf_model`'s weights; `frozen`: a reference
        copy (eval mode, no gradients). `trainer.activation_checkpointing` is megatron-
        core's recomputation of every layer."""
        from rft_hpc.megatron.policy import build_policy

        mcfg = self.config.trainer.megatron
        policy = build_policy(hf_model, tensor_parallel=mcfg.tensor_parallel,
                              pipeline_parallel=mcfg.pipeline_parallel,
                              divisible_by=mcfg.make_vocab_size_divisible_by,
                              device=self.device,
                              recompute=self.config.trainer.activation_checkpointing
                              and not frozen)
        if frozen:
            policy.eval()
            for p in policy.parameters():
                p.requires_grad_(False)
        return policy

    def distribute(self) -> None:
        """Nothing: `build` made this rank's shard."""

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The full vocabulary's float32 logits (gathered over the TP group); padded rows
        only (`packs_prompts` is False), so `position_ids` is always None."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          use_cache=False).logits.float()

    def idle_pass(self, pad_id: int) -> None:
        """A zero-loss pass of one token (`torch_backend.idle_pass`)."""
        idle_pass(self.model, self.device, pad_id)

    def reduce_gradients(self) -> None:
        """Sum the gradients over the data-parallel group (a collective of every rank;
        nothing without data parallelism)."""
        from megatron.core import parallel_state as ps

        if ps.get_data_parallel_world_size() > 1:
            all_reduce_gradients(self.model.parameters(), self.dist,
                                 group=ps.get_data_parallel_group())

    def clip_gradients(self, max_norm: float) -> float:
        """`clip_grad_norm`: over the full model, not this shard."""
        return clip_grad_norm(self.model, max_norm)

    def full_state(self) -> dict[str, torch.Tensor]:
        """The HF state dict gathered from the shards (a collective, complete on rank 0)."""
        return self.model.hf_state()

    def checkpoint_parts(self, optimizer: torch.optim.Optimizer
                         ) -> tuple[MegatronState, MegatronState]:
        """Views of both full states, gathered (a collective, complete on rank 0)."""
        return (MegatronState(self.model, None, self.model.hf_state()),
                MegatronState(self.model, optimizer, full_optimizer_state(self.model,
                                                                          optimizer)))

    def restore_parts(self, optimizer: torch.optim.Optimizer
                      ) -> tuple[MegatronState, MegatronState]:
        """Views that load a full state into this rank's shards."""
        return MegatronState(self.model, None), MegatronState(self.model, optimizer)
