"""Megatron-core backend pieces: HF <-> GPTModel weights, TP/PP shards (docs/megatron.md)."""
