"""LoRA adapters with the `peft` library: add one to a model, read and load its tensors,
describe it as peft's `adapter_config.json`, merge it into the base.

Adapter tensors travel (published, broadcast, exported) under peft's own names, as
`get_peft_model_state_dict` gives them and `adapter_model.safetensors` holds them, e.g.
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`. A state dict is an
adapter's when every name holds `.lora_A.` or `.lora_B.`; the rest of a published
version's description (rank, alpha, target modules) is `adapter_config`.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from rft_hpc.config.lora import LoraSettings
from rft_hpc.core.errors import UserError

ADAPTER_FILE = "adapter_model.safetensors"
"""The adapter's tensors in a peft adapter folder."""
ADAPTER_CONFIG_FILE = "adapter_config.json"
"""The adapter's description in a peft adapter folder."""
ADAPTER_PARTS = (".lora_A.", ".lora_B.")
"""What an adapter tensor's name holds (peft's names and the model's alike)."""
_PARTS = ADAPTER_PARTS


def _peft() -> Any:
    """The `peft` module, imported on first use: only `model.lora` needs it, and a plain
    `pip install rft-hpc` (no `lora` extra) must run everything else. Any: peft is optional,
    so its types cannot be named here."""
    try:
        return importlib.import_module("peft")
    except ModuleNotFoundError as exc:
        raise UserError("model.lora needs the peft library, which is not installed: "
                        "pip install 'rft-hpc[lora]'") from exc


# Any: peft is optional (see _peft), so its LoraConfig cannot be named here
def peft_config(settings: LoraSettings, base_model: str | None = None) -> Any:
    """peft's `LoraConfig` for a causal LM with these settings."""
    return _peft().LoraConfig(r=settings.rank, lora_alpha=settings.alpha,
                      lora_dropout=settings.dropout, target_modules=settings.target_modules,
                      task_type="CAUSAL_LM", base_model_name_or_path=base_model)


def add_adapter(model: torch.nn.Module, settings: LoraSettings, seed: int = 0,
                ) -> torch.nn.Module:
    """`model` with a fresh LoRA adapter (peft's `get_peft_model`: B = 0, so it computes
    what `model` did; A drawn from `seed`, the same in every process, whatever the global
    RNGs hold). Only the adapter's parameters require gradients; the base layers are
    changed in place (wrapped), not copied."""
    peft = _peft()
    with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
        torch.manual_seed(seed)
        return peft.get_peft_model(model, peft_config(settings))


def is_adapted(model: torch.nn.Module) -> bool:
    """True when `model` carries a peft adapter. A model can only carry one once peft is
    imported (`add_adapter` imports it), so this never imports peft itself."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def is_adapter_state(state: Mapping[str, Any]) -> bool:
    """True when `state` holds adapter tensors only (peft names, see the module doc)."""
    return bool(state) and all(any(p in name for p in _PARTS) for name in state)


def adapter_state(model: torch.nn.Module,
                  full: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's names, from `model` itself or from `full`, a
    state dict of the whole adapted model (a gathered FSDP state)."""
    full_state = None if full is None else dict(full)
    return dict(_peft().get_peft_model_state_dict(model, state_dict=full_state))


def load_adapter_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy an adapter's tensors (peft names) into `model`'s adapter, strictly: every
    adapter tensor of the model must be given and nothing else (ValueError otherwise)."""
    expected = set(adapter_state(model))
    if set(state) != expected:
        odd = sorted(set(state) ^ expected)
        raise ValueError(f"adapter tensors differ from the model's adapter: {odd[:3]}")
    _peft().set_peft_model_state_dict(model, dict(state))


def model_names(state: Mapping[str, torch.Tensor], adapter: str = "default",
                ) -> dict[str, torch.Tensor]:
    """`state` (peft names) under the adapted model's own parameter names (the adapter's
    name inserted: `.lora_A.default.weight`), as `state_dict()` and FSDP's state-dict
    functions name them."""
    out = {}
    for name, tensor in state.items():
        for part in _PARTS:
            name = name.replace(part, f"{part}{adapter}.")
        out[name] = tensor
    return out


def peft_names(state: Mapping[str, torch.Tensor], adapter: str = "default",
               ) -> dict[str, torch.Tensor]:
    """`state` under the adapted model's own names (`model_names`) back under peft's."""
    out = {}
    for name, tensor in state.items():
        for part in _PARTS:
            name = name.replace(f"{part}{adapter}.", part)
        out[name] = tensor
    return out


def target_modules(names: Iterable[str]) -> list[str]:
    """The module names (last component) that adapter tensors `names` belong to, sorted."""
    found = set()
    for name in names:
        for part in _PARTS:
            if part in name:
                found.add(name.split(part)[0].rsplit(".", 1)[-1])
    return sorted(found)


def adapter_config(settings: LoraSettings, tensor_names: Iterable[str],
                   base_model: str | Path | None) -> dict[str, Any]:
    """peft's `adapter_config.json` of an adapter with these settings and tensors: the
    target modules are those the tensors belong to (`all-linear` resolved), so the file
    loads in peft and vLLM whatever the settings named."""
    names = list(tensor_names)
    resolved = settings.model_copy(update={"target_modules": target_modules(names)})
    config = peft_config(resolved, None if base_model is None else str(base_model)).to_dict()
    config["inference_mode"] = True
    return json.loads(json.dumps(config, default=_json_default))


def _json_default(value: object) -> list[object]:
    if isinstance(value, set | frozenset):
        return sorted(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def merged_model(model: torch.nn.Module) -> torch.nn.Module:
    """The base model with the adapter's update added into its weights (peft's
    `merge_and_unload`): a plain transformers model that computes what the adapted one did."""
    return model.merge_and_unload()
