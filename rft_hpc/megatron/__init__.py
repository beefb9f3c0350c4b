"""Megatron-core backend pieces: HF Llama <-> Megatron GPTModel weights, TP/PP shards.

`convert` maps state dicts between the two layouts, `shards` splits a full Megatron state
dict over tensor/pipeline-parallel ranks and gathers it back (what weight sync publishes),
`model` builds a GPTModel from an HF config, `policy` wraps this rank's GPTModel shard in
the forward the trainer's loss code calls, `cpu` lets megatron-core run on CPUs.
docs/megatron.md describes the layouts and the training loop (rft_hpc.trainer.
megatron_backend). `convert` and `shards` need torch alone; the others import megatron-core
when called.
"""
