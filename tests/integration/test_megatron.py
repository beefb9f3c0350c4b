"""The Megatron-core backend's weights: HF <-> Megatron conversion and TP/PP shards.

Real torch, real megatron-core (a GPTModel constructed on the CPU, its parallel_state over
gloo), real processes for the gathers. The training loop on these pieces (GPTModel forward
and backward on CPUs) is tested in tests/integration/test_megatron_train.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.paths import HELPERS, ROOT
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from rft_hpc.megatron.convert import (
    ModelShape,
    StateDict,
    hf_to_megatron,
    megatron_to_hf,
    padded_vocab_size,
)
from rft_hpc.megatron.shards import (
    Layout,
    merge_stages,
    merge_tensor,
    shard_state,
    tp_cut,
)
from rft_hpc.models.tiny import TinyModelSpec, init_tiny_model

WORKER = HELPERS / "megatron_workers.py"


def merge_shards(shards: dict[tuple[int, int], dict[str, torch.Tensor]], layout: Layout
                 ) -> StateDict:
    """Inverse of `shard_state` in memory (the pieces `gather_full_state` merges with, without
    the process groups): the full state dict from every rank's shard."""
    tp = layout.tensor_parallel
    stages = []
    for stage in range(layout.pipeline_parallel):
        keys = shards[stage, 0].keys()
        stages.append({k: merge_tensor([shards[stage, r][k] for r in range(tp)], tp_cut(k))
                       for k in keys})
    return merge_stages(stages, layout)


def gqa_config(tied: bool = False, family: str = "llama") -> PretrainedConfig:
    """A small model of `family` (llama, qwen2: q/k/v biases, qwen3: q/k norms) with
    grouped-query attention: 8 query heads over 2 key/value heads."""
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    return cls(vocab_size=19, hidden_size=64, intermediate_size=96,
               num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
               max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=tied)


def hf_model(config: PretrainedConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms start at 1, biases at 0: make them distinct
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.02)
    return model


def hf_weights(config: PretrainedConfig) -> dict[str, torch.Tensor]:
    state = hf_model(config).state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


TINY_FAMILIES = {"llama": TinyModelSpec(), "llama-chat": TinyModelSpec(chat=True),
                 "qwen2": TinyModelSpec(arch="qwen2"), "qwen3": TinyModelSpec(arch="qwen3"),
                 "mistral": TinyModelSpec(arch="mistral")}


@pytest.fixture(scope="module")
def family_models(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path
                  ) -> dict[str, Path]:
    """The tiny model folder of each family (llama: the demo's, `tiny_model`)."""
    return {name: tiny_model if name == "llama" else
            init_tiny_model(tmp_path_factory.mktemp(name), spec)
            for name, spec in TINY_FAMILIES.items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), key


def test_tiny_model_round_trip_exact(tiny_model: Path) -> None:
    config = LlamaConfig.from_pretrained(tiny_model)
    hf = load_file(tiny_model / "model.safetensors")
    shape = ModelShape.from_hf(config)
    for spec in ("local", "te"):
        mg = hf_to_megatron(hf, shape, spec=spec, padded_vocab=padded_vocab_size(
            shape.vocab_size, 2))
        assert mg["embedding.word_embeddings.weight"].shape[0] == 256
        assert_same(megatron_to_hf(mg, shape, spec=spec), hf)


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_family_round_trip_exact(family_models: dict[str, Path], family: str) -> None:
    """HF -> Megatron -> HF gives back every tensor of each family's tiny model bit for bit
    (both norm namings), with the family's own weights on the Megatron side."""
    folder = family_models[family]
    config = AutoConfig.from_pretrained(folder)
    hf = load_file(folder / "model.safetensors")
    shape = ModelShape.from_hf(config)
    assert (shape.qkv_bias, shape.qk_norm, shape.tied) == (
        family == "qwen2", family == "qwen3", family.startswith("qwen"))
    for spec in ("local", "te"):
        mg = hf_to_megatron(hf, shape, spec=spec, padded_vocab=padded_vocab_size(
            shape.vocab_size, 2, 8))
        assert ("decoder.layers.3.self_attention.linear_qkv.bias" in mg) is shape.qkv_bias
        assert ("decoder.layers.3.self_attention.k_layernorm.weight" in mg) is shape.qk_norm
        assert ("output_layer.weight" in mg) is not shape.tied
        assert_same(megatron_to_hf(mg, shape, spec=spec), hf)
    print(f"{family}: {len(hf)} tensors, round trip exact (max |diff| 0)")


@pytest.mark.parametrize("tied", [False, True])
def test_gqa_round_trip_exact_and_layout(tied: bool) -> None:
    config = gqa_config(tied)
    hf = hf_weights(config)
    shape = ModelShape.from_hf(config)
    mg = hf_to_megatron(hf, shape, padded_vocab=24)
    assert ("output_layer.weight" in mg) is not tied
    assert_same(megatron_to_hf(mg, shape), hf)

    # Megatron's grouped layout: group g = its 4 query heads, then key head g, value head g
    d, qkv = 8, mg["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert qkv.shape == ((8 + 2 * 2) * d, 64)
    group1 = qkv[6 * d:12 * d]
    assert torch.equal(group1[:4 * d], hf["model.layers.1.self_attn.q_proj.weight"][4 * d:])
    assert torch.equal(group1[4 * d:5 * d], hf["model.layers.1.self_attn.k_proj.weight"][d:])
    assert torch.equal(group1[5 * d:], hf["model.layers.1.self_attn.v_proj.weight"][d:])
    fc1 = mg["decoder.layers.1.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[:96], hf["model.layers.1.mlp.gate_proj.weight"])
    assert torch.equal(fc1[96:], hf["model.layers.1.mlp.up_proj.weight"])
    assert torch.equal(mg["decoder.layers.1.pre_mlp_layernorm.weight"],
                       hf["model.layers.1.post_attention_layernorm.weight"])
    assert not mg["embedding.word_embeddings.weight"][19:].any()  # padding rows are zero


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_layout(family: str) -> None:
    """Qwen2's q/k/v biases fuse in the grouped layout of the weights; Qwen3's q/k norms
    are the attention's q_layernorm / k_layernorm; both round-trip exactly."""
    config = gqa_config(True, family)
    hf = hf_weights(config)
    shape = ModelShape.from_hf(config)
    mg = hf_to_megatron(hf, shape, padded_vocab=24)
    assert_same(megatron_to_hf(mg, shape), hf)
    h, m = "model.layers.1.self_attn.", "decoder.layers.1.self_attention."
    if family == "qwen2":
        d, bias = 8, mg[m + "linear_qkv.bias"]
        assert bias.shape == ((8 + 2 * 2) * d,)
        group1 = bias[6 * d:12 * d]  # group 1: its 4 query heads, key head 1, value head 1
        assert torch.equal(group1[:4 * d], hf[h + "q_proj.bias"][4 * d:])
        assert torch.equal(group1[4 * d:5 * d], hf[h + "k_proj.bias"][d:])
        assert torch.equal(group1[5 * d:], hf[h + "v_proj.bias"][d:])
    else:
        assert torch.equal(mg[m + "q_layernorm.weight"], hf[h + "q_norm.weight"])
        assert torch.equal(mg[m + "k_layernorm.weight"], hf[h + "k_norm.weight"])
        assert not torch.equal(hf[h + "q_norm.weight"], hf[h + "k_norm.weight"])


def test_conversion_refuses_what_it_does_not_map() -> None:
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        ModelShape.from_hf(AutoConfig.for_model("gpt2"))
    with pytest.raises(ValueError, match="sliding-window"):
        ModelShape.from_hf(Qwen2Config(use_sliding_window=True, sliding_window=16))
    with pytest.raises(ValueError, match="attention_bias"):
        ModelShape.from_hf(Qwen3Config(attention_bias=True))


def test_conversion_refuses_unmapped_keys() -> None:
    config = gqa_config()
    hf = hf_weights(config)
    shape = ModelShape.from_hf(config)
    with pytest.raises(ValueError, match=r"model\.layers\.9\.extra"):
        hf_to_megatron({**hf, "model.layers.9.extra": torch.zeros(1)}, shape)
    mg = hf_to_megatron(hf, shape)
    del mg["decoder.layers.3.mlp.linear_fc2.weight"]
    with pytest.raises(KeyError, match=r"decoder\.layers\.3\.mlp\.linear_fc2"):
        megatron_to_hf(mg, shape)


@pytest.mark.parametrize(("tp", "pp", "tied", "family"), [
    (2, 1, False, "llama"), (1, 2, True, "llama"), (2, 2, False, "llama"),
    (2, 2, True, "llama"), (2, 2, True, "qwen2"), (2, 1, False, "qwen3")])
def test_shards_merge_back_exactly(tp: int, pp: int, tied: bool, family: str) -> None:
    config = gqa_config(tied, family)
    shape = ModelShape.from_hf(config)
    full = hf_to_megatron(hf_weights(config), shape, padded_vocab=24)
    layout = Layout.for_model(shape, tp, pp)
    assert layout == Layout(tp, pp, 4, tied)
    shards = shard_state(full, layout)
    assert len(shards) == tp * pp
    last = shards[pp - 1, tp - 1]
    assert ("decoder.layers.2.input_layernorm.weight" in last) is (pp == 1)  # 4 layers / pp
    assert last["decoder.layers.1.mlp.linear_fc2.weight"].shape == (64, 96 // tp)
    assert last["decoder.layers.1.self_attention.linear_qkv.weight"].shape == (96 // tp, 64)
    assert last["output_layer.weight"].shape == (24 // tp, 64)  # tied, pp>1: a copy
    fc1 = last["decoder.layers.1.mlp.linear_fc1.weight"]  # this rank's gate rows, then up rows
    layer = f"decoder.layers.{4 - 4 // pp + 1}.mlp.linear_fc1.weight"
    gate, up = full[layer].chunk(2)
    assert torch.equal(fc1, torch.cat([gate.chunk(tp)[-1], up.chunk(tp)[-1]]))
    attn, global_attn = "decoder.layers.1.self_attention.", layer.removesuffix(
        "mlp.linear_fc1.weight") + "self_attention."
    if family == "qwen2":  # the bias is cut as its weight's rows: whole query groups
        assert torch.equal(last[attn + "linear_qkv.bias"],
                           full[global_attn + "linear_qkv.bias"].chunk(tp)[-1])
    if family == "qwen3":  # per-head norms are replicated
        assert torch.equal(last[attn + "q_layernorm.weight"],
                           full[global_attn + "q_layernorm.weight"])
    assert_same(merge_shards(shards, layout), full)


def test_layout_refuses_sizes_that_cut_a_query_group() -> None:
    shape = ModelShape.from_hf(gqa_config())
    with pytest.raises(ValueError, match="2 key/value heads do not split over 4 ranks"):
        Layout.for_model(shape, 4, 1)  # qkv's 96 rows would split into 4, but not by group
    with pytest.raises(ValueError, match="4 layers do not split over 3 ranks"):
        Layout.for_model(shape, 1, 3)


@pytest.mark.needs_module("megatron.core")
def test_conversion_fits_a_real_gptmodel() -> None:
    """A megatron-core GPTModel built from the HF config has exactly the converted keys and
    shapes, loads them, and its modules then compute what the HF modules compute. (The full
    forward runs in `test_gptmodel_logits_equal_transformers`, in a child process with the
    CPU shims of rft_hpc.megatron.cpu.)"""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from rft_hpc.megatron.model import build_gpt_model, load_megatron_state, weights_of

    config = gqa_config()
    hf = hf_model(config)
    shape = ModelShape.from_hf(config)
    mg = hf_to_megatron(hf.state_dict(), shape, padded_vocab=24)
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        model = build_gpt_model(config, padded_vocab=24, cpu_init=True).eval()
        real = weights_of(model)
        assert {k: tuple(v.shape) for k, v in real.items()} == {
            k: tuple(v.shape) for k, v in mg.items()}
        load_megatron_state(model, mg)
        assert_same(weights_of(model), mg)
        with torch.no_grad():
            assert_modules_compute_like_hf(model, hf)
    finally:
        parallel_state.destroy_model_parallel()
        if own:
            dist.destroy_process_group()


def assert_modules_compute_like_hf(model: torch.nn.Module, hf: torch.nn.Module) -> None:
    """Megatron's own forward code of each converted piece (sequence-first tensors) against
    the HF module: the grouped QKV split, SwiGLU MLP, norms, embedding, output layer and
    the rotary embedding's convention."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    s, b = 5, 3
    torch.manual_seed(1)
    x = torch.randn(s, b, 64)
    ids = torch.randint(0, 19, (b, s))
    for i in range(2):
        layer, ref = model.decoder.layers[i], hf.model.layers[i]
        q, k, v = layer.self_attention.get_query_key_value_tensors(x)[:3]
        attn = ref.self_attn
        assert torch.equal(q, attn.q_proj(x).view(s, b, 8, 8))
        assert torch.equal(k, attn.k_proj(x).view(s, b, 2, 8))
        assert torch.equal(v, attn.v_proj(x).view(s, b, 2, 8))
        assert torch.equal(layer.mlp(x)[0], ref.mlp(x))
        assert torch.equal(layer.input_layernorm(x), ref.input_layernorm(x))
        assert torch.equal(layer.pre_mlp_layernorm(x), ref.post_attention_layernorm(x))
        assert torch.allclose(layer.self_attention.linear_proj(x)[0], attn.o_proj(x))
    assert torch.equal(model.decoder.final_layernorm(x), hf.model.norm(x))
    assert torch.equal(model.embedding(ids, None), hf.model.embed_tokens(ids).transpose(0, 1))
    assert torch.equal(model.output_layer(x)[0][..., :19], hf.lm_head(x))

    # RoPE: Megatron's table (its inv_freq, rotate-half layout) applied by Megatron's code
    # equals HF's rotation of the same q: no permutation of q/k rows is needed
    inv = model.rotary_pos_emb.inv_freq
    freqs = torch.outer(torch.arange(s, dtype=inv.dtype), inv)
    table = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]
    rotated = apply_rotary_pos_emb(q, table, config=model.config)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_rope

    cos, sin = hf.model.rotary_emb(x.transpose(0, 1), torch.arange(s)[None].expand(b, s))
    want, _ = hf_rope(q.permute(1, 2, 0, 3), q.permute(1, 2, 0, 3), cos, sin)
    assert torch.allclose(rotated, want.permute(2, 0, 1, 3), atol=1e-6)
    assert not torch.allclose(rotated, q, atol=1e-3)  # the rotation did something


def run_ranks(tmp_path: Path, mode: str, tp: int, pp: int, config: PretrainedConfig
              ) -> dict[str, torch.Tensor]:
    weights, cfg = tmp_path / "hf.safetensors", tmp_path / "config.json"
    hf = hf_weights(config)
    save_file(hf, weights)
    cfg.write_text(json.dumps(config.to_dict()))
    out, init = tmp_path / "gathered.safetensors", tmp_path / "init"
    world = tp * pp
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world),
               "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKER), mode, str(weights), str(cfg), str(tp), str(pp),
             str(out), str(init)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True))
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
    gathered = load_file(out)
    assert_same(gathered, hf)
    return gathered


def test_gather_over_gloo_tp2_pp2(tmp_path: Path) -> None:
    """4 ranks (TP=2 x PP=2), each holding only its shard, rebuild the full HF weights."""
    run_ranks(tmp_path, "plain", 2, 2, gqa_config())


@pytest.mark.needs_module("megatron.core")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_gather_real_gptmodel_tp2(tmp_path: Path, family: str) -> None:
    """2 ranks init megatron-core's parallel_state at TP=2 over gloo, each loads its shard
    into a real TP=2 GPTModel (every key and shape must fit: Qwen3's replicated q/k norms
    too); gathering the models' state_dict() gives the HF weights. (Qwen2 at TP=2 trains in
    tests/integration/test_megatron_train.py.)"""
    run_ranks(tmp_path, "megatron", 2, 1, gqa_config(family == "qwen3", family))


@pytest.mark.needs_module("megatron.core")
def test_gptmodel_logits_equal_transformers(tmp_path: Path, family_models: dict[str, Path]
                                            ) -> None:
    """megatron-core's GPTModel, converted from each family's tiny model (norms made
    distinct), computes transformers' logits on a right-padded batch: the whole forward,
    biases, q/k norms, rotary embeddings, tied output layer and padding mask included.
    Float32 on CPUs (float noise, ~5e-7); 2e-3 on CUDA, as tools/device/megatron_check.py."""
    out, families = tmp_path / "logits.pt", ("llama", "qwen2", "qwen3")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(WORKER), "logits", str(out),
                           *(str(family_models[f]) for f in families)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = torch.load(out)
    for family in families:
        result = results[str(family_models[family])]
        diff = float((result["megatron"] - result["hf"]).abs().max())
        print(f"{family}: GPTModel vs transformers logits, max |diff| {diff:.3g} "
              f"(logits up to {float(result['hf'].abs().max()):.3g})")
        assert diff <= (2e-3 if torch.cuda.is_available() else 1e-5), family
