"""A LoRA run end to end (`rft-hpc run` with `model.lora`): explorers apply each published
adapter through peft, an interrupted run resumes to the same adapter as an uninterrupted
one, and `rft-hpc export` writes the adapter (peft layout) or the merged model, which peft
and transformers load and which answer as the run's own final evaluation did."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
import torch
from helpers.export_checks import final_eval, greedy_answers
from helpers.paths import DEMO, ROOT
from helpers.runs import EVALUATOR, rft, rollouts, scores_match_trainer, short
from helpers.slurm_runs import heartbeat, wait_until

from rft_hpc.config import load_config
from rft_hpc.core.rundir import RunDir, read_jsonl
from rft_hpc.monitor.metrics import read_metrics
from rft_hpc.sync.storage import load_safetensors
from rft_hpc.sync.weight_files import load_weights, read_manifest
from rft_hpc.tasks.source import build_tasks

STEPS = 8


def args(tmp_path, model, name):
    """Deterministic: strictly on-policy, one explorer, batches of one explorer step. The
    tiny model never earns a reward, so an entropy bonus gives every step its gradient."""
    return ["run", DEMO, *short(tmp_path, model, "--set", "stages=[]",
                                "--set", f"run.name={name}", "--set", "explorer.count=1",
                                "--set", "sync.offset=0", "--set", "trainer.batch_size=16",
                                "--set", f"trainer.steps={STEPS}", "--set", "eval.interval=0",
                                "--set", "trainer.save_interval=100", "--set", "trainer.lr=1e-2",
                                "--set", "algorithm.entropy_loss_fn=default",
                                "--set", "algorithm.entropy_loss_fn_args={entropy_coef: 0.1}",
                                "--set", "model.lora={rank: 8, alpha: 16}")]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_model):
    """An uninterrupted LoRA run's stage folder."""
    tmp = tmp_path_factory.mktemp("lora-run")
    result = rft(*args(tmp, tiny_model, "straight"), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp / "straight" / "stages" / "0-main"


@pytest.mark.timeout(600)
def test_an_interrupted_lora_run_resumes_to_the_same_adapter(straight, tmp_path, tiny_model):
    run = tmp_path / "stopped"
    stage = run / "stages" / "0-main"
    proc = subprocess.Popen([sys.executable, "-m", "rft_hpc.cli",
                             *map(str, args(tmp_path, tiny_model, "stopped"))],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: heartbeat(run, "trainer").get("step", 0) >= 3, 300, "trainer step 3")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "run the same command again" in err, err[-2000:]
    assert (stage / "ckpt" / "LATEST").read_text().startswith("trainer/step-")
    resumed = rft(*args(tmp_path, tiny_model, "stopped"), timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    manifest = read_manifest(stage / "weights", STEPS)
    assert manifest["kind"] == "lora-adapter" and manifest["adapter"]["r"] == 8
    one = load_weights(straight / "weights", STEPS)
    two = load_weights(stage / "weights", STEPS)
    assert sorted(one) == sorted(two) and all(".lora_" in k for k in one)
    assert all(bool(one[k].abs().max() > 1e-3) for k in one if ".lora_B." in k)  # it trained
    diff = max(float((one[k] - two[k]).abs().max()) for k in one)
    print(f"final adapter, uninterrupted vs interrupted once: max |diff| {diff:.3g}")
    assert diff <= 1e-6
    # the trainer checkpoint holds the adapter, and AdamW state for its tensors only
    ckpt = stage / "ckpt" / "trainer" / f"step-{STEPS:06d}"
    tensors, _ = load_safetensors(ckpt / "model.safetensors")
    assert len(tensors) == len(one) and all(".lora_" in k for k in tensors)
    assert len(torch.load(ckpt / "optimizer.pt")["state"]) == len(one)
    report = rft("audit", run, "--json")
    assert report.returncode == 0, report.stdout[-3000:]
    assert json.loads(report.stdout)["stages"][0]["trainer"]["restarts"] == 1
    # strictly on-policy: explorer step s sampled with adapter version s, applied by peft
    assert sorted({r.policy_version for r in rollouts(stage)}) == list(range(STEPS))


@pytest.mark.timeout(600)
def test_exported_adapter_and_merged_model_answer_as_the_run(straight, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rft_hpc.engines.hf import HFEngine

    run = straight.parents[1]
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    done = rft("export", run, "--out", adapter, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"exported weights v{STEPS} of 0-main (lora-adapter" in done.stdout
    done = rft("export", run, "--out", merged, "--merged", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer_config.json"} <= \
        {p.name for p in adapter.iterdir()}
    assert "model.safetensors" in {p.name for p in merged.iterdir()}

    config = load_config(straight / "config.yaml")
    _, tasks = build_tasks(config.tasks, config.run.seed)
    base = AutoModelForCausalLM.from_pretrained(str(config.model.path), local_files_only=True)
    peft_model = PeftModel.from_pretrained(base, str(adapter), local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(adapter), local_files_only=True)
    n = config.eval.max_new_tokens
    _, from_adapter = greedy_answers(HFEngine(model=peft_model, tokenizer=tokenizer,
                                              prompt=config.prompt), tasks, n)
    scores, from_merged = greedy_answers(HFEngine(merged, prompt=config.prompt), tasks, n)
    recorded = [a["answer"] for a in read_jsonl(RunDir(straight).heldout_answers(STEPS))]
    assert from_adapter == recorded
    assert from_merged == recorded
    assert scores["greedy_accuracy"] == final_eval(straight)["eval_accuracy"]
    start = [a["answer"] for a in read_jsonl(RunDir(straight).heldout_answers(0))]
    assert start != recorded  # the adapter changed what the model answers
    bad = rft("export", straight.parents[1], "--out", tmp_path / "x", "--merged", "--version",
              "999")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


@pytest.mark.timeout(600)
def test_a_lora_stage_starts_from_the_adapter_the_stage_before_ended_with(tmp_path,
                                                                          tiny_model):
    """The demo's two stages with `model.lora`: SFT trains an adapter, GRPO starts from it in
    the trainer and in the explorer alike (its first step, strictly on-policy, sees the
    trainer's log-probs equal the rollouts': approx_kl 0, ratio 1), and the evaluator role
    scores the adapters as the trainer did."""
    result = rft("run", DEMO, *short(
        tmp_path, tiny_model, "--set", "explorer.count=1", "--set", "sync.offset=0",
        "--set", "trainer.batch_size=16", "--set", "trainer.steps=2",
        "--set", "stages.0.trainer.lr=1e-2", "--set", "model.lora={rank: 8, alpha: 16}",
        *EVALUATOR), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    # the evaluator applied the start adapter (version 0) and the last one as the trainer did
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    sft, grpo = (tmp_path / "demo" / "stages" / name for name in ("0-sft", "1-grpo"))
    assert scores_match_trainer(summary, grpo, [0, 2])
    start = load_weights(sft / "weights", 8)
    assert read_manifest(sft / "weights", 8)["kind"] == "lora-adapter"
    assert any(float(t.abs().max()) > 1e-3 for k, t in start.items() if ".lora_B." in k)
    first = next(r for r in read_metrics(grpo / "metrics" / "trainer.jsonl") if "loss" in r)
    print(f"grpo step 1 from the sft adapter: approx_kl {first['approx_kl']:.3g}, "
          f"ratio_mean {first['ratio_mean']:.9f}")
    assert abs(first["approx_kl"]) < 1e-6 and first["ratio_mean"] == pytest.approx(1, abs=1e-6)
    assert read_manifest(grpo / "weights", 2)["kind"] == "lora-adapter"
    # ... and the explorer sampled its first step with that adapter, not the base model
    from rft_hpc.batch.logprobs import token_logprobs
    from rft_hpc.batch.tokens import collate
    from rft_hpc.engines.hf import HFEngine

    config = load_config(grpo / "config.yaml")
    engine = HFEngine(tiny_model, lora=config.model.lora)
    batch = collate([r for r in rollouts(grpo) if r.step == 0], pad_id=engine.pad_id)
    mask = batch.loss_mask.bool()
    with torch.no_grad():
        base = token_logprobs(engine.model.eval(), batch)
        engine.load_weights(start, 0)
        adapted = token_logprobs(engine.model.eval(), batch)
    torch.testing.assert_close(batch.old_logprobs[mask], adapted[mask], atol=1e-5, rtol=0)
    assert float((base - adapted)[mask].abs().max()) > 1e-2


@pytest.mark.timeout(600)
def test_bench_mode_scores_a_lora_runs_adapters(straight, tmp_path):
    """`rft-hpc eval RUN`: the published adapters are scored as adapters over the run's
    model folder (loaded as whole models they would be refused), with the scores of the run's
    own evaluation."""
    out = tmp_path / "out"
    result = rft("eval", straight.parents[1], "--k", "1", "--local", "--out", out, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    results = {r["checkpoint"]: r for r in
               json.loads((out / "bench" / "results.json").read_text())["results"]}
    assert {"base", f"main-v{STEPS:06d}"} <= set(results), sorted(results)
    evals = {r["step"]: r["eval_accuracy"] for r in
             read_metrics(straight / "metrics" / "trainer.jsonl") if "eval_accuracy" in r}
    assert results["base"]["greedy_accuracy"] == evals[0]
    assert results[f"main-v{STEPS:06d}"]["greedy_accuracy"] == evals[STEPS]
