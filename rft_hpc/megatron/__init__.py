"""Megatron-core backend pieces: HF Llama <-> Megatron GPTModel weights, TP/PP shards.

`convert` maps state dicts between the two layouts, `shards` splits a full Megatron state
dict over tensor/pipeline-parallel ranks and gathers it back (what weight sync publishes),
`model` builds a GPTModel from an HF config. docs/megatron.md describes the layouts.
Only `model` imports megatron-core; the rest needs torch alone.
"""
