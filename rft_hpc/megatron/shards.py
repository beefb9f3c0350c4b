"""Split a full Megatron GPTModel state dict over TP x PP ranks, and gather it back.

Tensor parallelism (TP) cuts each weight the way megatron-core's parallel layers hold it:
column-parallel layers (`linear_qkv`, `linear_fc1`) on dim 0, `linear_fc1` per half (each
rank holds its slice of the gate rows followed by its slice of the up rows), row-parallel
layers (`linear_proj`, `linear_fc2`) on dim 1, the vocab-parallel embedding and output
layer on dim 0; norms are replicated. Pipeline parallelism (PP) gives stage p the layers
[p*L/PP, (p+1)*L/PP), numbered from 0 in its own state dict, the first stage the embedding,
the last the final norm and the output layer (with tied embeddings and PP > 1 the last
stage keeps a copy of the embedding as `output_layer.weight`, as megatron-core does).

`gather_full_state` is what weight sync calls: every rank passes its shard, global rank 0
gets the full state dict (TP gather, then each stage's TP leader sends its part to rank 0).
docs/megatron.md shows the layout.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from rft_hpc.megatron.convert import ModelShape, StateDict

Cut = Literal["column", "glu", "row", "replicated"]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


def tp_cut(key: str) -> Cut:
    """How tensor parallelism cuts the weight named `key` (a GPTModel state dict key)."""
    if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return "column"
    if key.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        return "column"
    if key.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        return "glu"
    if key.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "row"
    if "layernorm" in key or key.endswith(("layer_norm_weight", "layer_norm_bias",
                                           "linear_proj.bias", "linear_fc2.bias")):
        return "replicated"
    raise ValueError(f"no tensor-parallel rule for weight {key!r}")


def split_tensor(t: torch.Tensor, cut: Cut, size: int) -> list[torch.Tensor]:
    """`t` cut into `size` TP shards (copies); refuses sizes that do not divide evenly."""
    if cut == "replicated":
        return [t.clone() for _ in range(size)]
    dim = 1 if cut == "row" else 0
    parts = 2 if cut == "glu" else 1
    if t.shape[dim] % (size * parts):
        raise ValueError(f"dim {dim} of size {t.shape[dim]} does not split into {size} shards")
    if cut == "glu":
        gate, up = (h.chunk(size) for h in t.chunk(2))
        return [torch.cat([g, u]) for g, u in zip(gate, up, strict=True)]
    return [c.clone() for c in t.chunk(size, dim=dim)]


def merge_tensor(shards: list[torch.Tensor], cut: Cut) -> torch.Tensor:
    """Inverse of `split_tensor`: the full weight from its TP shards in rank order."""
    if cut == "replicated":
        return shards[0].clone()
    if cut == "row":
        return torch.cat(shards, dim=1)
    if cut == "glu":
        halves = [s.chunk(2) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards)


@dataclass(frozen=True)
class Layout:
    """The parallel layout: TP and PP sizes, the model's layer count, tied embeddings."""

    tensor_parallel: int
    pipeline_parallel: int
    num_layers: int
    tied: bool = False

    @classmethod
    def for_model(cls, shape: ModelShape, tensor_parallel: int = 1,
                  pipeline_parallel: int = 1) -> Layout:
        """The layout of this model at these sizes; a `ValueError` naming what does not
        divide (the TP cut of `linear_qkv` is only right when whole query groups go to
        each rank, which its row count alone cannot tell)."""
        for what, count, size in (("key/value heads", shape.num_kv_heads, tensor_parallel),
                                  ("attention heads", shape.num_heads, tensor_parallel),
                                  ("layers", shape.num_layers, pipeline_parallel)):
            if count % size:
                raise ValueError(f"the model's {count} {what} do not split over {size} ranks")
        return cls(tensor_parallel, pipeline_parallel, shape.num_layers, shape.tied)

    def stage_layers(self, stage: int) -> range:
        """Global layer numbers held by pipeline stage `stage`."""
        if self.num_layers % self.pipeline_parallel:
            raise ValueError(f"{self.num_layers} layers do not split into "
                             f"{self.pipeline_parallel} pipeline stages")
        per = self.num_layers // self.pipeline_parallel
        return range(stage * per, (stage + 1) * per)


def stage_state(full: Mapping[str, torch.Tensor], layout: Layout, stage: int) -> StateDict:
    """The part of a full state dict that pipeline stage `stage` holds, layers renumbered
    from 0 (tensors shared with `full`, not copied)."""
    layers = layout.stage_layers(stage)
    first, last = stage == 0, stage == layout.pipeline_parallel - 1
    out: StateDict = {}
    for key, value in full.items():
        match = _LAYER.match(key)
        if match:
            index = int(match.group(1))
            if index in layers:
                out[f"decoder.layers.{index - layers.start}.{match.group(2)}"] = value
        elif ((first and key.startswith("embedding."))
              or (last and key.startswith(("decoder.final_layernorm.", "output_layer.")))):
            out[key] = value
    if last and layout.tied and layout.pipeline_parallel > 1:
        out["output_layer.weight"] = full["embedding.word_embeddings.weight"]
    return out


def shard_state(full: Mapping[str, torch.Tensor], layout: Layout
                ) -> dict[tuple[int, int], StateDict]:
    """Every rank's shard of a full state dict, keyed by (pipeline stage, TP rank)."""
    tp = layout.tensor_parallel
    shards: dict[tuple[int, int], StateDict] = {}
    for stage in range(layout.pipeline_parallel):
        part = stage_state(full, layout, stage)
        cut = {k: split_tensor(v, tp_cut(k), tp) for k, v in part.items()}
        for rank in range(tp):
            shards[stage, rank] = {k: pieces[rank] for k, pieces in cut.items()}
    return shards


def merge_stages(stages: list[StateDict], layout: Layout) -> StateDict:
    """Full state dict from the TP-merged state of each pipeline stage, in stage order."""
    out: StateDict = {}
    for stage, part in enumerate(stages):
        offset = layout.stage_layers(stage).start
        for key, value in part.items():
            match = _LAYER.match(key)
            if match:
                key = f"decoder.layers.{int(match.group(1)) + offset}.{match.group(2)}"
            elif key == "output_layer.weight" and layout.tied:
                continue  # the last stage's copy of the tied embedding
            out[key] = value
    return out




def gather_full_state(local: Mapping[str, torch.Tensor], layout: Layout,
                      tp_group: dist.ProcessGroup | None = None,
                      pp_group: dist.ProcessGroup | None = None) -> StateDict | None:
    """The full state dict on global rank 0 (None on the other ranks), from each rank's
    shard `local` (`_extra_state` entries are skipped).

    Every rank of both groups must call this. `tp_group`: this rank's tensor-parallel group
    (ranks of one stage, in TP-rank order); `pp_group`: its pipeline group (ranks with the
    same TP rank, in stage order). None means a group of one. Tensors travel one by one
    (gather within TP, point-to-point across stages), so peak memory on rank 0 is the full
    model plus one weight's shards; works on gloo (CPUs) and NCCL alike.
    """
    local = {k: v for k, v in local.items() if not k.endswith("._extra_state")}
    merged = _gather_tp(local, tp_group)
    if merged is None:
        return None
    stages = _gather_pp(merged, pp_group)
    return None if stages is None else merge_stages(stages, layout)


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def _gather_tp(local: StateDict, group: dist.ProcessGroup | None) -> StateDict | None:
    size = _size(group)
    if size == 1:
        return dict(local)
    lead = _rank(group) == 0
    dst = dist.get_global_rank(group, 0)
    out: StateDict = {}
    for key in sorted(local):
        cut = tp_cut(key)
        if cut == "replicated":
            out[key] = local[key]
            continue
        t = local[key].contiguous()
        pieces = [torch.empty_like(t) for _ in range(size)] if lead else None
        dist.gather(t, pieces, dst=dst, group=group)
        if lead:
            out[key] = merge_tensor(pieces, cut)
    return out if lead else None


def _gather_pp(merged: StateDict, group: dist.ProcessGroup | None) -> list[StateDict] | None:
    size = _size(group)
    if size == 1:
        return [merged]
    me = _rank(group)
    meta = {k: (tuple(v.shape), v.dtype) for k, v in merged.items()}
    metas: list[dict[str, tuple[tuple[int, ...], torch.dtype]]] | None = (
        [{}] * size if me == 0 else None)
    dst = dist.get_global_rank(group, 0)
    dist.gather_object(meta, metas, dst=dst, group=group)
    if me != 0:
        for key in sorted(merged):
            dist.send(merged[key].contiguous(), dst=dst, group=group)
        return None
    assert metas is not None
    stages = [merged]
    for stage in range(1, size):
        src = dist.get_global_rank(group, stage)
        part: StateDict = {}
        for key in sorted(metas[stage]):
            shape, dtype = metas[stage][key]
            part[key] = torch.empty(shape, dtype=dtype)
            dist.recv(part[key], src=src, group=group)
        stages.append(part)
    return stages
