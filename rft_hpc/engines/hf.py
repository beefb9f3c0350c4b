"""The transformers inference engine: batched sampling with per-token log-probs, on CPUs.

Log-probs are those of the sampling distribution: raw logits divided by the temperature
(no top-k or top-p), which is what the trainer recomputes for the policy ratio. With
`model.lora` the weights versions are LoRA adapters, applied through peft on the loaded
model (the base is never reloaded).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rft_hpc.config.lora import LoraSettings
from rft_hpc.config.prompt import PromptConfig
from rft_hpc.engines.requests import Completion, FinishedGroup, GroupRequest
from rft_hpc.models.attention import use_native_gqa_on_cpu
from rft_hpc.models.lora import add_adapter, is_adapted, is_adapter_state, load_adapter_state
from rft_hpc.tasks.prompts import prompt_ids, stop_token_ids, truncate_at_stop
from rft_hpc.tasks.task import Task

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_dtype(setting: str, device: str | torch.device | None = None) -> torch.dtype:
    """The dtype `model.dtype` means for weights that go to `device`: `auto` is bfloat16
    on a CUDA device (with `device` None: when this machine has CUDA), else float32."""
    if setting == "auto":
        cuda = torch.cuda.is_available() if device is None else \
            torch.device(device).type == "cuda"
        return torch.bfloat16 if cuda else torch.float32
    return DTYPES[setting]


def load_policy(model_path: str | Path, dtype: str = "float32",
                device: str | torch.device | None = None,
                ) -> tuple[PreTrainedTokenizerBase, PreTrainedModel]:
    """Tokenizer and causal LM from a local Hugging Face folder (never a hub), on the CPU,
    in `model_dtype(dtype, device)`: `device` is where the caller will put the model.
    Grouped-query layers on CPUs attend without copying keys and values (`models.attention`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    use_native_gqa_on_cpu()
    tokenizer = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(model_path), local_files_only=True,
                                                 dtype=model_dtype(dtype, device))
    return tokenizer, model


def _misfits(state_dict: Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor],
             most: int = 5) -> list[str]:
    """What keeps `state_dict` from loading into a model whose tensors are `targets`: the
    tensors it lacks, those it has in excess and those of another shape (at most `most`
    of each); empty when it fits."""
    missing = [k for k in targets if k not in state_dict]
    extra = [k for k in state_dict if k not in targets]
    shapes = [f"{k} {tuple(t.shape)} for {tuple(targets[k].shape)}"
              for k, t in state_dict.items() if k in targets and t.shape != targets[k].shape]
    return [f"{what} {', '.join(keys[:most])}{' ...' if len(keys) > most else ''}"
            for what, keys in (("missing", missing), ("unexpected", extra),
                               ("shape", shapes)) if keys]


class HFEngine:
    """Generates groups of completions for token-id prompts with a transformers model (an
    `engines.protocol.StreamingEngine`)."""

    def __init__(self, model_path: str | Path | None = None, *, dtype: str = "float32",
                 device: str = "cpu", model: PreTrainedModel | None = None,
                 tokenizer: PreTrainedTokenizerBase | None = None,
                 prompt: PromptConfig | None = None, lora: LoraSettings | None = None) -> None:
        """The model of the Hugging Face folder `model_path` on `device`, or the `model`
        and `tokenizer` given (used as they are: the trainer's evaluation replica)."""
        if model is None:
            if model_path is None:
                raise ValueError("HFEngine needs a model folder, or a model and its tokenizer")
            tokenizer, model = load_policy(model_path, dtype, device)
            model.to(device).eval()
        if tokenizer is None:
            raise ValueError("HFEngine was given a model without its tokenizer")
        self.tokenizer: PreTrainedTokenizerBase = tokenizer
        self.model: PreTrainedModel | PeftModel = model
        """The policy: the transformers model, wrapped by peft once `enable_lora` ran."""
        self.device = device
        self.prompt = prompt if prompt is not None else PromptConfig()
        """How `prompt_ids` turns a task into tokens."""
        self.eos_id = self.tokenizer.eos_token_id
        generation = getattr(model, "generation_config", None)
        self.stop_ids = stop_token_ids(self.tokenizer, getattr(generation, "eos_token_id", None),
                                       self.prompt)
        """Tokens that end a response: EOS and the chat template's end-of-turn token(s)."""
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
            else self.eos_id
        self.version = 0
        """Version of the weights loaded (0 = the initial model)."""
        self.lora = lora
        """The LoRA adapter the versions are (None: they are whole models)."""
        self._queue: deque[GroupRequest] = deque()
        self._targets: tuple[torch.nn.Module, dict[str, torch.Tensor]] | None = None

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace the model's weights in place with a published state dict (copied: the
        caller may reuse its tensors afterwards): a whole model's, or with `lora` set an
        adapter's, which goes into the adapter (added at the first one) and leaves the base
        as it is. A whole model's must hold every tensor of the model, each of its shape, and
        no other (ValueError naming what does not fit otherwise, and nothing is loaded)."""
        if self.lora is not None and is_adapter_state(state_dict):
            self.enable_lora()
            load_adapter_state(self.model, state_dict)
        elif is_adapted(self.model):
            raise ValueError(f"weights {version} are a whole model, but this engine applies "
                             "LoRA adapters: load whole models before the adapter is added")
        else:
            targets = self._weights_of_model()
            misfits = _misfits(state_dict, targets)
            if misfits:
                raise ValueError(f"weights {version} do not fit the engine's model: "
                                 + "; ".join(misfits))
            with torch.no_grad():  # load_state_dict's copies, without its walk of modules
                for name, tensor in state_dict.items():
                    targets[name].copy_(tensor)
        self.version = version

    def _weights_of_model(self) -> dict[str, torch.Tensor]:
        """The model's own parameters and buffers by state-dict name (kept while the model
        object is the same)."""
        if self._targets is None or self._targets[0] is not self.model:
            self._targets = (self.model, self.model.state_dict(keep_vars=True))
        return self._targets[1]

    def enable_lora(self, seed: int = 0) -> None:
        """Add the `lora` adapter to the model (once; a fresh adapter changes no output; its
        A matrices are drawn from `seed`)."""
        if self.lora is None:
            raise ValueError("this engine has no model.lora settings")
        if not is_adapted(self.model):
            self.model = add_adapter(self.model, self.lora, seed)

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a raw text prompt (with the tokenizer's special tokens)."""
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def plain_tokens(self, text: str) -> list[int]:
        """Token ids of a text without special tokens (an environment's observation)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, task: Task) -> list[int]:
        """Token ids of a task's prompt in the engine's prompt format (`tasks.prompts`)."""
        return prompt_ids(self.tokenizer, task, self.prompt)

    def context_limit(self) -> int | None:
        """The model's max positions (None when its config has none)."""
        limit = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        return int(limit) if isinstance(limit, int) else None

    def close(self) -> None:
        """Nothing to free beyond this process's memory: the model goes with the engine."""

    def generate(self, prompts: Sequence[Sequence[int]], *, n: int, max_new_tokens: int,
                 temperature: float, seed: int) -> list[list[Completion]]:
        """`n` completions per prompt; temperature 0 decodes greedily (log-probs at T=1).

        Sample k of prompt i is drawn with seed `seed + i * n + k` alone: the same prompts,
        weights and seed give the same completions, and a prompt's samples do not depend on
        the other prompts of the call (up to float order).
        """
        return self._generate([(p, seed + i * n) for i, p in enumerate(prompts)], n,
                              max_new_tokens, temperature)

    def submit(self, requests: Sequence[GroupRequest]) -> None:
        """Queue group requests (`engines.requests`); `poll` serves them."""
        self._queue.extend(requests)

    @property
    def in_flight(self) -> int:
        """Group requests submitted and not yet returned by `poll`."""
        return len(self._queue)

    def poll(self) -> list[FinishedGroup]:
        """Generate the queued requests in one `generate` call (the oldest, and every one
        after it that shares its n, token budget and temperature) and return their groups;
        [] when nothing is queued. Sample k of a group is drawn with seed `seed + k`."""
        if not self._queue:
            return []
        def shape(r: GroupRequest) -> tuple[int, int, float]:
            return r.n, r.max_new_tokens, r.temperature

        first = shape(self._queue[0])
        batch = []
        while self._queue and shape(self._queue[0]) == first:
            batch.append(self._queue.popleft())
        groups = self._generate([(r.prompt, r.seed) for r in batch], *first)
        return [FinishedGroup(r.key, g) for r, g in zip(batch, groups, strict=True)]

    @torch.no_grad()
    def _generate(self, seeded: Sequence[tuple[Sequence[int], int]], n: int,
                  max_new_tokens: int, temperature: float) -> list[list[Completion]]:
        """`n` completions of each `(prompt, seed)`, sample k drawn with `seed + k`."""
        from transformers import GenerationConfig, LogitsProcessorList

        was_training = self.model.training
        self.model.eval()
        rows = [list(p) for p, _ in seeded for _ in range(n)]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):  # left padding: every prompt ends at column `width`
            ids[i, width - len(r):] = torch.tensor(r)
            mask[i, width - len(r):] = 1
        greedy = temperature <= 0
        # sampling is greedy decoding of Gumbel-perturbed scores (RowSampler), so do_sample
        # stays off and no processor of transformers' own touches the scores
        config = GenerationConfig(
            do_sample=False, temperature=None, top_k=None, top_p=None,
            max_new_tokens=max_new_tokens, pad_token_id=self.pad_id,
            eos_token_id=list(self.stop_ids), bos_token_id=self.tokenizer.bos_token_id,
            output_logits=True, return_dict_in_generate=True)
        sampler = None if greedy else LogitsProcessorList([RowSampler(
            [seed + k for _, seed in seeded for k in range(n)], temperature, self.device)])
        try:
            # every n-th row is a prompt's first; all end at column `width`
            cache = self._shared_prefill(ids[::n, :-1], mask[::n, :-1], n) \
                if n > 1 and width > 1 else None
            out = self.model.generate(input_ids=ids.to(self.device),
                                      attention_mask=mask.to(self.device),
                                      past_key_values=cache, generation_config=config,
                                      logits_processor=sampler)
        finally:
            self.model.train(was_training)
        new = out.sequences[:, width:]
        logits = torch.stack(out.logits, dim=1).float()  # [rows, steps, vocab], raw
        logp = torch.log_softmax(logits / (1.0 if greedy else temperature), dim=-1)
        # gathered where they were computed: only [rows, steps] leave the device
        token_logp = logp.gather(-1, new.unsqueeze(-1)).squeeze(-1).cpu()
        new = new.cpu()
        completions = [self._completion(new[i], token_logp[i]) for i in range(len(rows))]
        return [completions[i * n:(i + 1) * n] for i in range(len(seeded))]

    def _shared_prefill(self, ids: torch.Tensor, mask: torch.Tensor, n: int,
                        ) -> DynamicCache:
        """The KV cache of each prompt but its last token (`ids`, `mask`: one left-padded row
        per prompt, that token cut off), computed once and repeated for the prompt's `n`
        rows: `generate` then starts from the last token. A group's rows share their prompt,
        and its prefill is most of a short completion's cost."""
        from transformers import DynamicCache

        # the positions `generate` gives left-padded rows: counted from each row's first token
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                   position_ids=positions.to(self.device), past_key_values=cache,
                   use_cache=True, logits_to_keep=1)
        cache.batch_repeat_interleave(n)
        return cache

    def _completion(self, tokens: torch.Tensor, logp: torch.Tensor) -> Completion:
        toks, finished = truncate_at_stop(tokens.tolist(), self.stop_ids)
        text = self.tokenizer.decode(toks, skip_special_tokens=True)
        return Completion(toks, logp[:len(toks)].tolist(), text, finished,
                          versions=[(self.version, 0)])


class RowSampler:
    """A logits processor that samples each row of a batch from softmax(scores / T) with a
    generator of its own: argmax(scores / T + Gumbel noise) is such a sample (the Gumbel-max
    trick), so greedy decoding of what this returns samples. A row's tokens then depend on
    its seed alone, not on which rows share its batch or in what order: requests can be
    batched however they arrive."""

    def __init__(self, seeds: Sequence[int], temperature: float,
                 device: str | torch.device = "cpu") -> None:
        self.temperature = temperature
        self.generators = [torch.Generator(device).manual_seed(s) for s in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The scores over the temperature plus one Gumbel draw per row and token."""
        vocab = scores.shape[-1]
        uniform = torch.stack([torch.rand(vocab, generator=g, device=scores.device)
                               for g in self.generators])
        gumbel = -torch.log(-torch.log(uniform.clamp_min(torch.finfo(uniform.dtype).tiny)))
        return scores.float() / self.temperature + gumbel
