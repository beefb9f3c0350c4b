"""`${VAR}` and `~` in path settings: expanded when the config is loaded, so the config a
run freezes holds the expanded paths; an unset variable is a config error."""

from pathlib import Path

import pytest
import yaml

from rft_hpc.config import ConfigError, load_config
from rft_hpc.core.rundir import RunDir
from rft_hpc.run.stages import freeze_run_config

CONFIG = """\
run: {name: r, root: "${SCRATCH}/runs"}
model: {path: "~/models/${MODEL_NAME}", start_weights: "${SCRATCH}/weights/v000003"}
tasks: {type: file, path: "${DATA}/train.parquet", eval_path: "~/eval.jsonl"}
data: {source: jsonl, path: "${DATA}/sft.jsonl"}
explorer: {vllm: {scratch_dir: "${SCRATCH}/vllm"}}
"""


def test_variables_and_home_are_expanded_and_frozen(tmp_path, monkeypatch):
    monkeypatch.setenv("SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.setenv("DATA", "/proj/data")
    monkeypatch.setenv("MODEL_NAME", "qwen")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home" / "models" / "qwen").mkdir(parents=True)
    (tmp_path / "scratch" / "weights" / "v000003").mkdir(parents=True)  # a published version
    (tmp_path / "scratch" / "weights" / "v000003" / "manifest.json").write_text("{}")
    (tmp_path / "exp.yaml").write_text(CONFIG)
    config = load_config(tmp_path / "exp.yaml")
    home, scratch = tmp_path / "home", tmp_path / "scratch"
    assert config.run.root == scratch / "runs"
    assert config.model.path == home / "models" / "qwen"
    assert config.model.start_weights == scratch / "weights" / "v000003"
    assert config.tasks.path == Path("/proj/data/train.parquet")
    assert config.tasks.eval_path == home / "eval.jsonl"
    assert config.data.path == Path("/proj/data/sft.jsonl")
    assert config.explorer.vllm.scratch_dir == scratch / "vllm"
    run = RunDir(tmp_path / "run")
    freeze_run_config(config, run)
    frozen = yaml.safe_load(run.config.read_text())
    assert frozen["run"]["root"] == str(scratch / "runs")
    assert frozen["tasks"]["path"] == "/proj/data/train.parquet"
    assert "$" not in run.config.read_text() and "~" not in run.config.read_text()
    monkeypatch.delenv("DATA")  # the frozen config no longer needs the variables
    assert load_config(run.config).tasks.path == Path("/proj/data/train.parquet")


def test_an_unset_variable_names_the_key_and_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("NO_SUCH_DIR_VAR", raising=False)
    (tmp_path / "exp.yaml").write_text("run: {root: '${NO_SUCH_DIR_VAR}/runs'}\n"
                                       "tasks: {type: file, path: '${bad name}/x.jsonl'}\n")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "exp.yaml")
    text = str(info.value)
    assert "run.root" in text and "environment variable NO_SUCH_DIR_VAR is not set" in text
    assert "tasks.path" in text and "${bad name} is not a variable name" in text
