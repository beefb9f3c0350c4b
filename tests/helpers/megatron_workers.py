"""One rank of a TP/PP shard-gather test, run as a script by tests/integration/test_megatron.py.

usage: megatron_workers.py {plain,megatron} HF_SAFETENSORS HF_CONFIG_JSON TP PP OUT INIT_FILE
(RANK and WORLD_SIZE come from the environment). Each rank takes its own shard of the HF
model's Megatron state; `plain` gathers it over torch.distributed groups built here,
`megatron` first loads it into a real GPTModel under megatron-core's parallel_state and
gathers that model's state_dict() over parallel_state's groups. Rank 0 writes the gathered
HF state dict to OUT.

usage: megatron_workers.py logits OUT MODEL_DIR... (one process): for each HF model folder,
the logits of megatron-core's GPTModel converted from it (norms made distinct first) and of
transformers' model, on a right-padded batch; OUT gets both per folder (real tokens only).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist
from safetensors.torch import load_file, save_file

from rft_hpc.megatron.convert import ModelShape, hf_to_megatron, padded_vocab_size
from rft_hpc.megatron.publish import gather_hf_state
from rft_hpc.megatron.shards import Layout, shard_state


def plain_groups(tp: int, pp: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Megatron's rank order: rank = stage * tp + tp_rank. Every rank creates every group."""
    rank = dist.get_rank()
    mine: list[dist.ProcessGroup] = []
    for stage in range(pp):
        group = dist.new_group([stage * tp + r for r in range(tp)])
        if rank // tp == stage:
            mine.append(group)
    for r in range(tp):
        group = dist.new_group([s * tp + r for s in range(pp)])
        if rank % tp == r:
            mine.append(group)
    return mine[0], mine[1]


def main(mode: str, weights: str, config: str, tp: int, pp: int, out: str, init: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    hf_config = SimpleNamespace(**json.loads(Path(config).read_text()))
    shape = ModelShape.from_hf(hf_config)
    vocab = padded_vocab_size(shape.vocab_size, tp, 8)
    layout = Layout.for_model(shape, tp, pp)
    full = hf_to_megatron(load_file(weights), shape, padded_vocab=vocab)
    local = shard_state(full, layout)[rank // tp, rank % tp]
    if mode == "megatron":
        from megatron.core import parallel_state

        from rft_hpc.megatron.model import build_gpt_model, load_megatron_state, weights_of

        parallel_state.initialize_model_parallel(tp, pp)
        model = build_gpt_model(hf_config, padded_vocab=vocab, tensor_parallel=tp,
                                pipeline_parallel=pp, cpu_init=True)
        load_megatron_state(model, local)  # raises on any missing key or shape mismatch
        local = weights_of(model)
        gathered = gather_hf_state(local, shape, layout)
    else:
        gathered = gather_hf_state(local, shape, layout, groups=plain_groups(tp, pp))
    if rank == 0:
        assert gathered is not None
        save_file(gathered, out)
    elif gathered is not None:
        raise SystemExit(f"rank {rank} got a state dict")
    dist.destroy_process_group()


def logits(out: str, *model_dirs: str) -> None:
    import torch
    from megatron.core import parallel_state
    from transformers import AutoModelForCausalLM

    from rft_hpc.megatron.cpu import enable_cpu_execution
    from rft_hpc.megatron.policy import build_policy

    torch.manual_seed(0)
    enable_cpu_execution()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    results = {}
    for model_dir in model_dirs:
        hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        with torch.no_grad():  # norms start at 1: make them distinct so a mix-up shows
            for name, p in hf.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
        policy = build_policy(hf, tensor_parallel=1, pipeline_parallel=1, divisible_by=8,
                              device=device).eval()
        hf.to(device)
        ids = torch.randint(0, hf.config.vocab_size, (3, 24), device=device)
        mask = torch.ones_like(ids)
        mask[1, 17:] = 0  # right padding, as the trainer's batches
        mask[2, 9:] = 0
        with torch.no_grad():
            want = hf(input_ids=ids, attention_mask=mask).logits
            got = policy(input_ids=ids, attention_mask=mask).logits
        real = mask.bool()
        results[model_dir] = {"hf": want[real].float().cpu(),
                              "megatron": got[real].float().cpu()}
    torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "logits":
        logits(*sys.argv[2:])
    else:
        m, w, c, t, p, o, i = sys.argv[1:]
        main(m, w, c, int(t), int(p), o, i)
    from rft_hpc.runtime.exit import leave_process

    leave_process(0)  # as `rft-hpc role trainer` ends: not through gloo's teardown
