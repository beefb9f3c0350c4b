"""The full HF state dict of a TP/PP-sharded Megatron model: what weight sync publishes."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from rft_hpc.megatron.convert import LayerSpec, ModelShape, StateDict, megatron_to_hf
from rft_hpc.megatron.shards import Layout, gather_full_state


def megatron_groups() -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """This rank's (TP, PP) groups from megatron-core's initialised `parallel_state`."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 \
        else None
    pp = ps.get_pipeline_model_parallel_group() \
        if ps.get_pipeline_model_parallel_world_size() > 1 else None
    return tp, pp


def gather_hf_state(local: Mapping[str, torch.Tensor], shape: ModelShape, layout: Layout, *,
                    spec: LayerSpec = "local",
                    groups: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None] | None
                    = None) -> StateDict | None:
    """Every rank passes its shard (e.g. `model.state_dict()`); global rank 0 gets the full
    HF state dict, the others None. `groups`: (TP group, PP group), by default
    megatron-core's `parallel_state` groups."""
    tp_group, pp_group = groups if groups is not None else megatron_groups()
    full = gather_full_state(local, layout, tp_group, pp_group)
    return None if full is None else megatron_to_hf(full, shape, spec=spec)
