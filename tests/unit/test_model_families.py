"""The tiny models of each family (`rft-hpc model init tiny --arch`): what makes each one
its family's, and the HF engine, the torch trainer's step and weight publishing on them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers.ranks import fixed_batch, write_config
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from rft_hpc.engines.hf import HFEngine, model_dtype
from rft_hpc.models.tiny import TinyModelSpec, init_tiny_model
from rft_hpc.sync.weight_files import load_weights, publish_weights

SPECS = {"llama-chat": TinyModelSpec(chat=True), "qwen2": TinyModelSpec(arch="qwen2"),
         "qwen3": TinyModelSpec(arch="qwen3"), "mistral": TinyModelSpec(arch="mistral")}
# (architecture, generation prompt, the tokens that end an assistant turn)
FAMILY = {
    "llama-chat": ("LlamaForCausalLM", "<|start_header_id|>assistant<|end_header_id|>\n\n",
                   ["<|eot_id|>", "<|end_of_text|>"]),
    "qwen2": ("Qwen2ForCausalLM", "<|im_start|>assistant\n", ["<|im_end|>", "<|endoftext|>"]),
    "qwen3": ("Qwen3ForCausalLM", "<|im_start|>assistant\n", ["<|im_end|>", "<|endoftext|>"]),
    "mistral": ("MistralForCausalLM", " [/INST]", ["</s>"]),
}
MESSAGES = [{"role": "system", "content": "Answer with a number."},
            {"role": "user", "content": "What is 12+30?"}]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: init_tiny_model(tmp_path_factory.mktemp(name), spec)
            for name, spec in SPECS.items()}


@pytest.mark.parametrize("name", list(SPECS))
def test_chat_models_are_their_familys(models: dict[str, Path], name: str) -> None:
    folder = models[name]
    arch, generation_prompt, end_of_turn = FAMILY[name]
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [arch]
    assert "chat_template" in json.loads((folder / "tokenizer_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text.endswith(generation_prompt) and "Answer with a number." in text
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert tok.decode(ids) == text  # special tokens are whole tokens, text is bytes
    ends = [tok.convert_tokens_to_ids(t) for t in end_of_turn]
    assert all(tok.decode([i]) == t for i, t in zip(ends, end_of_turn, strict=True))
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == (ends if len(ends) > 1 else ends[0])
    assert tok.eos_token == end_of_turn[0]
    state = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).state_dict()
    assert ("model.layers.0.self_attn.q_proj.bias" in state) is (name == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in state) is (name == "qwen3")
    assert config["tie_word_embeddings"] is name.startswith("qwen")
    if name == "qwen2":  # biases start random, not at transformers' zeros
        assert state["model.layers.0.self_attn.k_proj.bias"].abs().min() > 0
    if name == "qwen3":
        assert state["model.layers.0.self_attn.q_norm.weight"].shape == (64,)  # own head_dim
        assert not torch.equal(state["model.layers.0.self_attn.q_norm.weight"],
                               state["model.layers.0.self_attn.k_norm.weight"])


def test_the_default_tiny_model_is_the_character_llama(tiny_model: Path) -> None:
    config = json.loads((tiny_model / "config.json").read_text())
    assert (config["vocab_size"], config["num_key_value_heads"]) == (20, 4)
    assert "chat_template" not in json.loads((tiny_model / "tokenizer_config.json").read_text())


def test_a_byte_tokenizer_filled_to_qwen25s_size(tmp_path: Path) -> None:
    """filler tokens put Qwen2.5's special tokens at its ids; text still encodes to bytes,
    and every filler id (two bytes each, three past 65536) decodes to its own bytes."""
    from rft_hpc.models.families import FAMILIES
    from rft_hpc.models.tokenizer import build_byte_tokenizer

    q = FAMILIES["qwen2"]
    build_byte_tokenizer(tmp_path, special=q.special, bos=q.bos, eos=q.eos, pad=q.pad,
                         chat_template=q.template, filler=151643 - 256)
    tok = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert len(tok) == 151646
    assert tok.convert_tokens_to_ids(list(q.special)) == [151643, 151644, 151645]
    assert tok("Hi 1+2=")["input_ids"] == list(b"Hi 1+2=")
    assert tok.decode([256]) == "\x00\x00" and tok.decode([256 + 0x4142]) == "AB"
    assert tok.decode([256 + 65536 + 0x014243]) == "\x01BC"
    assert len({tok.convert_ids_to_tokens(i) for i in range(151643)}) == 151643


def test_a_chat_model_with_merges_learned_from_its_corpus(tmp_path: Path) -> None:
    """merges learned from a corpus write its words in one token each and every digit
    alone; special tokens stay whole, any text round-trips, and ids below 256 are still
    the bytes."""
    corpus = [f"<s>[INST] What is the code of account {n}? [/INST]{n % 7}</s>"
              for n in range(1000, 1400)]
    out = init_tiny_model(tmp_path, TinyModelSpec(arch="mistral", num_layers=1, merges=40,
                                                   rope_theta=1e4), corpus)
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    text = "[INST] What is the code of account 4578? [/INST]"
    pieces = tok.convert_ids_to_tokens(tok(text, add_special_tokens=False)["input_ids"])
    assert pieces[0] == "[INST]" and pieces[-1] == "[/INST]"
    assert {"Ġaccount", "Ġcode", "4", "5", "7", "8"} <= set(pieces)
    assert len(pieces) < len(text) / 2
    for other in (text, "Zebra 12345 {\"json\": true}\n\tü"):
        assert tok.decode(tok(other, add_special_tokens=False)["input_ids"]) == other
    assert tok.convert_ids_to_tokens(list(range(3))) == ["Ā", "ā", "Ă"]
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == len(tok)
    # the spec's rotary base, not the family's (Mistral's 1e6; docs/agents.md)
    assert AutoConfig.from_pretrained(str(out)).rope_parameters["rope_theta"] == 1e4


def test_model_dtype_auto() -> None:
    assert model_dtype("auto", "cpu") == torch.float32
    assert model_dtype("auto", "cuda") == torch.bfloat16
    assert model_dtype("auto") == (torch.bfloat16 if torch.cuda.is_available()
                                   else torch.float32)
    assert model_dtype("bfloat16", "cpu") == torch.bfloat16


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_engine_trainer_step_and_published_weights(tmp_path: Path, models: dict[str, Path],
                                                   name: str) -> None:
    """The HF engine samples from the model, the torch trainer takes a GRPO step on it, and
    the published weights hold what transformers' state dict holds (with tied embeddings
    `lm_head.weight` too) and load strictly into an engine that then samples with them."""
    from rft_hpc.config import load_config
    from rft_hpc.trainer.trainer import Trainer

    folder = models[name]
    engine = HFEngine(folder)
    prompt = engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    before = engine.generate([prompt], n=2, max_new_tokens=6, temperature=1.0, seed=3)[0]
    assert all(0 < len(c.tokens) <= 6 for c in before)
    assert all(math.isfinite(x) and x <= 0 for c in before for x in c.logprobs)

    config = load_config(write_config(tmp_path / "c.yaml", folder,
                                      algorithm={"algorithm_type": "grpo"},
                                      trainer={"lr": 1e-2, "batch_size": 8}))
    torch.manual_seed(0)
    trainer = Trainer(config)
    values = trainer.step(fixed_batch("grpo"))
    assert math.isfinite(values["loss"]) and values["grad_norm"] > 0
    trained = trainer.full_state_dict()
    start = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).state_dict()
    assert sorted(trained) == sorted(start) and "lm_head.weight" in trained
    assert torch.equal(trained["lm_head.weight"], trained["model.embed_tokens.weight"])
    changed = [k for k in start if not torch.equal(trained[k], start[k])]
    assert "model.layers.0.self_attn.q_proj.bias" in changed or name != "qwen2"
    assert "model.layers.0.self_attn.k_norm.weight" in changed or name != "qwen3"

    publish_weights(tmp_path / "weights", trained, 1)
    published = load_weights(tmp_path / "weights", 1)
    assert sorted(published) == sorted(start)
    engine.load_weights(published, 1)  # strict: every key of the model, no other
    loaded = engine.model.state_dict()
    assert all(torch.equal(loaded[k], trained[k]) for k in trained)
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight  # still tied
    after = engine.generate([prompt], n=2, max_new_tokens=6, temperature=1.0, seed=3)[0]
    assert [c.logprobs for c in after] != [c.logprobs for c in before]


def test_engine_refuses_weights_that_do_not_fit_its_model(models: dict[str, Path]) -> None:
    """A state dict with a tensor of another shape, a key too few or one too many loads
    nothing: the error names the tensor, and the engine keeps its weights and version."""
    engine = HFEngine(models["qwen3"])
    start = {k: v.clone() for k, v in engine.model.state_dict().items()}
    other = {k: v + 1 for k, v in start.items()}  # would change every tensor it loaded
    wrong_shape = {**other, "model.norm.weight": torch.ones(3)}
    missing = {k: v for k, v in other.items() if k != "model.norm.weight"}
    extra = {**other, "model.extra.weight": torch.ones(3)}
    for state, what in ((wrong_shape, r"shape model\.norm\.weight \(3,\) for \(\d+,\)"),
                        (missing, r"missing model\.norm\.weight"),
                        (extra, r"unexpected model\.extra\.weight")):
        with pytest.raises(ValueError, match=what):
            engine.load_weights(state, 1)
    assert engine.version == 0
    assert all(torch.equal(v, start[k]) for k, v in engine.model.state_dict().items())


def test_model_init_and_dtype_auto_in_a_config(tmp_path: Path) -> None:
    """`model.init: tiny-qwen3` builds that family's model where `model.path` points;
    `model.dtype: auto` is a valid setting, resolved where the weights are loaded."""
    from rft_hpc.config import load_config
    from rft_hpc.run.stages import prepare_model

    path = write_config(tmp_path / "c.yaml", tmp_path / "model")
    config = load_config(path, ["model.init=tiny-qwen3", "model.dtype=auto"])
    assert config.model.dtype == "auto"
    prepare_model(config)
    assert json.loads((tmp_path / "model" / "config.json").read_text())["architectures"] == [
        "Qwen3ForCausalLM"]
    engine = HFEngine(config.model.path, dtype=config.model.dtype)
    assert next(engine.model.parameters()).dtype == torch.float32  # on the CPU
