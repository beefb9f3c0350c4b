"""Build a megatron-core GPTModel equivalent to an HF decoder config (local layer spec):
Llama, Mistral, Qwen2 (q/k/v biases), Qwen3 (q/k layer norms), tied embeddings or not.

The local spec uses megatron-core's own modules (torch RMSNorm when Apex is missing), so
the model can be constructed on CPUs (`use_cpu_initialization`); its forward and backward
run there too with the shims of `rft_hpc.megatron.cpu`.
Call `megatron.core.parallel_state.initialize_model_parallel` before `build_gpt_model`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rft_hpc.megatron.convert import ModelShape, StateDict

if TYPE_CHECKING:
    from megatron.core.models.gpt.gpt_model import GPTModel
    from transformers import PretrainedConfig


def rope_theta(hf_config: PretrainedConfig) -> float:
    """The rotary base of an HF config (transformers 5 `rope_parameters` or older
    `rope_theta`); refuses rope scaling, which this backend does not map."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    kind = params.get("rope_type", "default")
    legacy = getattr(hf_config, "rope_scaling", None)
    if kind != "default" or (legacy and legacy.get("rope_type", "default") != "default"):
        raise ValueError(f"rope type {kind!r}: only plain rotary embeddings are mapped")
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def transformer_config_kwargs(hf_config: PretrainedConfig, *, tensor_parallel: int = 1,
                              pipeline_parallel: int = 1,
                              dtype: torch.dtype = torch.float32,
                              cpu_init: bool = False, recompute: bool = False) -> dict[str, Any]:
    """Keyword arguments of megatron-core's `TransformerConfig` for this HF config: the
    same shapes, RMSNorm, SwiGLU, q/k/v biases only where the family has them (Qwen2), q/k
    layer norms where it has them (Qwen3), no dropout, and no fused kernels that need Apex
    or Transformer Engine. `recompute`: activation checkpointing of every layer
    (megatron-core's full, uniform recomputation, one layer per checkpoint)."""
    shape = ModelShape.from_hf(hf_config)
    extra: dict[str, Any] = {}
    if recompute:
        extra = dict(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1)
    return dict(**extra,
        num_layers=shape.num_layers, hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads, num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim, ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, add_qkv_bias=shape.qkv_bias, qk_layernorm=shape.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        params_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=cpu_init, perform_initialization=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
    )


def build_gpt_model(hf_config: PretrainedConfig, *, padded_vocab: int, tensor_parallel: int = 1,
                    pipeline_parallel: int = 1, dtype: torch.dtype = torch.float32,
                    cpu_init: bool = False, recompute: bool = False) -> GPTModel:
    """A GPTModel (local spec) for this rank's pipeline stage, weights left uninitialised
    (load converted ones with `load_megatron_state`). Needs megatron-core and an
    initialised `parallel_state` with the same TP/PP sizes."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape = ModelShape.from_hf(hf_config)
    config = TransformerConfig(**transformer_config_kwargs(
        hf_config, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
        dtype=dtype, cpu_init=cpu_init, recompute=recompute))
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=shape.qk_norm)
    return GPTModel(
        config=config, transformer_layer_spec=spec,
        vocab_size=padded_vocab, max_sequence_length=hf_config.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=shape.tied,
        position_embedding_type="rope", rotary_base=rope_theta(hf_config))


def weights_of(model: torch.nn.Module) -> StateDict:
    """A model's state dict without `_extra_state` entries (detached tensors)."""
    return {k: v.detach() for k, v in model.state_dict().items()
            if not k.endswith("._extra_state")}


def load_megatron_state(model: torch.nn.Module, state: StateDict) -> None:
    """Copy `state` (this rank's shard) into `model`; every weight must be given and fit."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("._extra_state")]
    if missing or unexpected:
        raise ValueError(f"shard does not fit the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
