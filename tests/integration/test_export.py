"""`rft-hpc export`: a short chat-format run's final weights as a Hugging Face folder that
transformers and vLLM load as they are, with the run's own evaluation results."""

from __future__ import annotations

import pytest
from helpers.chat_models import chat_model
from helpers.export_checks import check_export_answers_as_the_run, check_vllm_logprobs, final_eval
from helpers.paths import DEMO
from helpers.runs import rft, short

from rft_hpc.core.rundir import RunDir, read_jsonl
from rft_hpc.engines.hf import HFEngine
from rft_hpc.monitor.metrics import read_metrics

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


def test_export_loads_in_transformers_and_answers_as_the_run(exported):
    stage, out = exported
    check_export_answers_as_the_run(stage, out, 2)
    assert 0.0 <= final_eval(stage)["eval_pass@2"] <= 1.0


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
    _, out = exported
    hf = HFEngine(out)
    check_vllm_logprobs(out, [hf.encode(t) for t in ("12+34=46", "hello, world", "7*6=42")])


def test_the_grpo_stage_starts_with_the_sft_stages_final_scores(exported):
    stage, _ = exported
    sft = stage.parent / "0-sft"
    first = next(r for r in read_metrics(stage / "metrics" / "trainer.jsonl")
                 if "eval_accuracy" in r)
    last = final_eval(sft)
    assert first["step"] == 0 and last["step"] == 4
    assert {k: v for k, v in first.items() if k.startswith("eval_")} == \
        {k: v for k, v in last.items() if k.startswith("eval_")}
    assert read_jsonl(RunDir(stage).heldout_answers(0)) == \
        read_jsonl(RunDir(sft).heldout_answers(4))
    assert "held-out scores of the starting weights carried from 0-sft" in \
        (stage / "jobs" / "trainer.log").read_text()
