"""Grouped-query attention on CPUs without the key/value copy (rft_hpc.models.attention) gives
what transformers' own `sdpa` gives: outputs and gradients, under every mask the project
passes (none, left padding's, the shared-prompt packing's 4D mask), in prefill and in
one-token decoding; and a model loaded by `load_policy` generates the same completions."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rft_hpc.engines.hf import HFEngine
from rft_hpc.models.attention import _sdpa_with_native_gqa
from rft_hpc.models.tiny import TinyModelSpec, init_tiny_model


class _Layer(nn.Module):
    num_key_value_groups = 3
    is_causal = True


def _masks(q_len: int, kv_len: int) -> dict[str, torch.Tensor | None]:
    pad = torch.ones(2, 1, q_len, kv_len, dtype=torch.bool)
    pad[0, ..., :3] = False  # row 0 left-padded by 3
    causal = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    blocks = causal.clone()
    blocks[q_len // 2:, kv_len - q_len: kv_len - q_len + q_len // 2] = False  # two rows packed
    additive = torch.zeros(2, 1, q_len, kv_len).masked_fill(~(pad & causal), float("-inf"))
    return {"none": None, "padding": pad & causal, "packed": (pad & blocks), "float": additive}


@pytest.mark.parametrize("q_len", [9, 1])
@pytest.mark.parametrize("mask", ["none", "padding", "packed", "float"])
def test_outputs_and_gradients_equal_transformers_sdpa(q_len: int, mask: str) -> None:
    torch.manual_seed(0)
    kv_len = 9
    query = torch.randn(2, 6, q_len, 16, requires_grad=True)
    key = torch.randn(2, 2, kv_len, 16, requires_grad=True)
    value = torch.randn(2, 2, kv_len, 16, requires_grad=True)
    attention_mask = _masks(q_len, kv_len)[mask]
    results = []
    for forward in (sdpa_attention_forward, _sdpa_with_native_gqa):
        out, _ = forward(_Layer(), query, key, value, attention_mask, scaling=0.25)
        grads = torch.autograd.grad(out.square().sum(), (query, key, value))
        results.append((out, grads))
    (want, want_grads), (got, got_grads) = results
    assert got.shape == want.shape == (2, q_len, 6, 16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_a_loaded_gqa_model_generates_what_eager_attention_generates(tmp_path) -> None:
    folder = init_tiny_model(tmp_path / "model", TinyModelSpec(arch="qwen2", num_layers=2))
    native = HFEngine(folder)  # load_policy: sdpa, with the native GQA path
    assert native.model.config.num_attention_heads > native.model.config.num_key_value_heads
    eager = HFEngine(folder)
    eager.model.set_attn_implementation("eager")
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    for temperature in (0.0, 1.0):
        a = native.generate(prompts, n=4, max_new_tokens=8, temperature=temperature, seed=3)
        b = eager.generate(prompts, n=4, max_new_tokens=8, temperature=temperature, seed=3)
        for ga, gb in zip(a, b, strict=True):
            for ca, cb in zip(ga, gb, strict=True):
                assert ca.tokens == cb.tokens
                assert ca.logprobs == pytest.approx(cb.logprobs, abs=1e-4)
