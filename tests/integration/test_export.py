"""`rft-hpc export`: a short chat-format run's final weights as a Hugging Face folder that
transformers and vLLM load as they are, with the run's own evaluation results."""

from __future__ import annotations

import pytest
import torch
from helpers.chat_models import chat_model
from helpers.paths import DEMO
from helpers.runs import rft, short

from rft_hpc.config import load_config
from rft_hpc.engines.hf import HFEngine
from rft_hpc.eval.bench_score import score_tasks
from rft_hpc.monitor.metrics import read_metrics
from rft_hpc.sync.checkpoint import load_weights
from rft_hpc.tasks.source import build_tasks

CHAT_RUN = ("--set", "prompt.format=chat", "--set", "prompt.system_prompt=Add.",
            "--set", "tasks.eval_size=16", "--set", "eval.k=2", "--set", "explorer.count=1",
            "--set", "stages.0.trainer.steps=4", "--set", "stages.0.eval.interval=0",
            "--set", "trainer.steps=2", "--set", "trainer.batch_size=16",
            "--set", "eval.interval=0")
"""One explorer, whose step (2 tasks x 8 rollouts) is one trainer batch."""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A finished two-stage chat run (SFT, then GRPO) and its export."""
    tmp = tmp_path_factory.mktemp("export")
    model = chat_model(tmp / "chat-llama")
    result = rft("run", DEMO, *short(tmp, model, *CHAT_RUN), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp / "exported"
    done = rft("export", tmp / "demo", "--out", out, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exported weights v2 of 1-grpo" in done.stdout
    return tmp / "demo" / "stages" / "1-grpo", out


def _answers(engine, tasks):
    answers: list[str] = []
    scores = score_tasks(engine, tasks, k=0, n=0, temperature=1.0, max_new_tokens=5,
                         batch_size=512, seed=0, answers=answers)
    return scores, answers


def test_export_loads_in_transformers_and_answers_as_the_run(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stage, out = exported
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "model.safetensors", "rft_hpc_export.json"} <= names
    published = load_weights(stage / "weights", 2)
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    assert model.state_dict().keys() == published.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in published.items())
    assert AutoTokenizer.from_pretrained(str(out), local_files_only=True).chat_template

    config = load_config(stage / "config.yaml")
    _, tasks = build_tasks(config.tasks, config.run.seed)
    final = [r for r in read_metrics(stage / "metrics" / "trainer.jsonl")
             if "eval_accuracy" in r][-1]
    assert final["step"] == 2 and 0.0 <= final["eval_pass@2"] <= 1.0
    from_export = HFEngine(out, prompt=config.prompt)
    scores, answers = _answers(from_export, tasks)
    assert scores["greedy_accuracy"] == final["eval_accuracy"]
    assert scores["greedy_reward"] == final["eval_reward"]
    in_run = HFEngine(config.model.path, prompt=config.prompt)
    in_run.load_weights(published, 2)
    assert _answers(in_run, tasks)[1] == answers


def test_bad_exports_say_why(exported):
    stage, out = exported
    run = stage.parents[1]
    again = rft("export", run, "--out", out)
    assert again.returncode == 2 and "not an empty folder" in again.stderr
    assert "Traceback" not in again.stderr
    missing = rft("export", run, "--out", out.parent / "other", "--version", "999")
    assert missing.returncode == 2 and "no weights version 999" in missing.stderr
    assert not (out.parent / "other").exists()
    stage_named = rft("export", run, "--out", out.parent / "sft", "--stage", "sft")
    assert stage_named.returncode == 0 and "v4 of 0-sft" in stage_named.stdout


@pytest.mark.needs_module("vllm")
def test_vllm_loads_the_export_and_agrees_on_logprobs(exported):
    from rft_hpc.batch.logprobs import token_logprobs
    from rft_hpc.batch.tokens import collate
    from rft_hpc.buffer.records import SFTSample
    from rft_hpc.config.schema import VLLMConfig
    from rft_hpc.engines.vllm import VLLMEngine

    _, out = exported
    hf = HFEngine(out)
    sequences = [hf.encode(text) for text in ("12+34=46", "hello, world", "7*6=42")]
    engine = VLLMEngine(out, settings=VLLMConfig(enforce_eager=True, kv_cache_gb=0.25))
    try:
        got = engine.sequence_logprobs(sequences)
    finally:
        engine.close()
    batch = collate([SFTSample(s, 1) for s in sequences], pad_id=hf.pad_id)
    with torch.no_grad():
        want = token_logprobs(hf.model, batch)
    for i, row in enumerate(got):
        assert torch.allclose(torch.tensor(row), want[i, :len(row)], atol=5e-5)
