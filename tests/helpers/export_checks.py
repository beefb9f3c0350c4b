"""The checks that an `rft-hpc export` folder is the run's model: transformers loads it with
the published tensors and answers the held-out tasks as the run's own final evaluation did;
vLLM loads it and agrees with transformers on log-probs. Shared by test_export.py and
test_real_workload.py."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rft_hpc.config import load_config
from rft_hpc.core.rundir import RunDir, read_jsonl
from rft_hpc.engines.hf import HFEngine
from rft_hpc.eval.scoring import score_tasks
from rft_hpc.monitor.metrics import read_metrics
from rft_hpc.sync.weight_files import load_weights
from rft_hpc.tasks.source import build_tasks
from rft_hpc.tasks.task import Task


def greedy_answers(engine: Any, tasks: Sequence[Task], max_new_tokens: int,
                   ) -> tuple[dict[str, Any], list[str]]:
    """`engine`'s scores on `tasks` (greedy only, each task's own reward) and its answers."""
    answers: list[dict[str, Any]] = []
    scores = score_tasks(engine, tasks, k=0, n=0, temperature=1.0,
                         max_new_tokens=max_new_tokens, batch_size=512, seed=0,
                         answers=answers)
    return scores, [a["answer"] for a in answers]


def final_eval(stage: Path) -> dict[str, Any]:
    """The trainer's last evaluation record of `stage` (its metrics line)."""
    return [r for r in read_metrics(stage / "metrics" / "trainer.jsonl")
            if "eval_accuracy" in r][-1]


def check_export_answers_as_the_run(stage: Path, out: Path, version: int) -> list[str]:
    """Assert that `out` (an export of weights `version` of `stage`) loads with
    AutoModelForCausalLM.from_pretrained holding exactly the published tensors, carries the
    chat template, and gives the run's final evaluation: the same greedy accuracy and mean
    reward, and the same greedy answer to each task as the run's evaluation recorded
    (eval/answers/). Returns the export's greedy answers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "model.safetensors", "rft_hpc_export.json"} <= names
    published = load_weights(stage / "weights", version)
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    assert model.state_dict().keys() == published.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in published.items())
    assert AutoTokenizer.from_pretrained(str(out), local_files_only=True).chat_template

    config = load_config(stage / "config.yaml")
    _, tasks = build_tasks(config.tasks, config.run.seed)
    final = final_eval(stage)
    assert final["step"] == version, final
    scores, answers = greedy_answers(HFEngine(out, prompt=config.prompt), tasks,
                                     config.eval.max_new_tokens)
    assert scores["greedy_accuracy"] == final["eval_accuracy"]
    assert scores["greedy_reward"] == final["eval_reward"]
    recorded = read_jsonl(RunDir(stage).heldout_answers(version))  # by the run's evaluation
    assert [a["answer"] for a in recorded] == answers
    return answers


def check_vllm_logprobs(out: Path, sequences: Sequence[Sequence[int]],
                        atol: float = 5e-5) -> None:
    """Assert that vLLM loads the folder `out` as it is and that its per-token log-probs
    of `sequences` equal transformers' within `atol`."""
    from rft_hpc.batch.logprobs import token_logprobs
    from rft_hpc.batch.tokens import collate
    from rft_hpc.buffer.records import SFTSample
    from rft_hpc.config.schema import VLLMConfig
    from rft_hpc.engines.vllm import VLLMEngine

    hf = HFEngine(out)
    engine = VLLMEngine(out, settings=VLLMConfig(enforce_eager=True, kv_cache_gb=0.25))
    try:
        got = engine.sequence_logprobs(sequences)
    finally:
        engine.close()
    batch = collate([SFTSample(list(s), 1) for s in sequences], pad_id=hf.pad_id)
    with torch.no_grad():
        want = token_logprobs(hf.model, batch)
    for i, row in enumerate(got):
        assert torch.allclose(torch.tensor(row), want[i, :len(row)], atol=atol), i
