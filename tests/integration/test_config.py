"""Config loading, overrides, error messages, the docs reference and `rft-hpc validate`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers.paths import ROOT
from pydantic import BaseModel

from rft_hpc.config import ConfigError, ExperimentConfig, load_config, schema
from rft_hpc.config.reference import render_reference, splice
from rft_hpc.config.renamed import RENAMED
from rft_hpc.core.errors import UserError


def write(tmp_path: Path, text: str, name: str = "exp.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def problems_of(path: Path, overrides: list[str] | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides or [])
    return info.value


# --- loading and overrides ------------------------------------------------------------------


def test_empty_file_gives_defaults(tmp_path):
    assert load_config(write(tmp_path, "")) == ExperimentConfig()
    assert load_config(write(tmp_path, "# only a comment\n")) == ExperimentConfig()


def test_defaults(tmp_path):
    cfg = load_config(write(tmp_path, ""))
    assert (cfg.run.name, cfg.run.root, cfg.run.seed, cfg.mode) == ("demo", Path("runs"), 0, "both")
    assert (cfg.model.path, cfg.model.dtype) == (None, "float32")
    assert (cfg.explorer.count, cfg.explorer.engine, cfg.explorer.repeat) == (1, "hf", 8)
    assert (cfg.algorithm.algorithm_type, cfg.trainer.lr, cfg.trainer.batch_size) == (
        "grpo", 1e-5, 64)
    assert (cfg.sync.method, cfg.sync.interval, cfg.sync.offset, cfg.sync.timeout) == (
        "checkpoint", 1, 0, 600.0)
    assert cfg.buffer.sampler.type == "fifo"


def test_empty_section_gives_its_defaults(tmp_path):
    cfg = load_config(write(tmp_path, "trainer:\nexplorer:\n  count: 3\n"))
    assert cfg.trainer == schema.TrainerConfig()
    assert cfg.explorer.count == 3


def test_demo_config_is_valid():
    cfg = load_config(ROOT / "configs" / "demo.yaml")
    assert cfg.run.name == "demo"
    assert cfg.explorer.count == 2
    assert cfg.trainer.batch_size == (
        cfg.explorer.count * cfg.explorer.tasks_per_step * cfg.explorer.repeat)


def test_overrides_float_int_and_new_sections(tmp_path):
    path = write(tmp_path, "trainer:\n  lr: 1.0e-5\n")
    cfg = load_config(path, ["trainer.lr=3e-4", "trainer.batch_size=7", "sync.offset=2",
                             "run.name=exp-1", "model.dtype=bfloat16"])
    assert cfg.trainer.lr == pytest.approx(3e-4)
    assert cfg.trainer.batch_size == 7
    assert cfg.sync.offset == 2
    assert cfg.run.name == "exp-1"
    assert cfg.model.dtype == "bfloat16"


def test_later_override_wins_and_value_may_contain_equals(tmp_path):
    cfg = load_config(write(tmp_path, ""), ["trainer.steps=3", "trainer.steps=5",
                                            "run.root=x=y"])
    assert cfg.trainer.steps == 5
    assert cfg.run.root == Path("x=y")


def test_override_sets_a_nested_mapping(tmp_path):
    cfg = load_config(write(tmp_path, ""),
                      ["buffer.sampler={type: mixture, weights: {math: 2, code: 1}}"])
    assert cfg.buffer.sampler.type == "mixture"
    assert cfg.buffer.sampler.weights == {"math": 2.0, "code": 1.0}


def test_override_switches_the_sampler_variant(tmp_path):
    path = write(tmp_path, "buffer:\n  sampler:\n    type: priority\n    reuse_decay: 0.3\n")
    assert load_config(path).buffer.sampler.reuse_decay == pytest.approx(0.3)
    assert load_config(path, ["buffer.sampler={type: fifo}"]).buffer.sampler.type == "fifo"
    cfg = load_config(write(tmp_path, "", "empty.yaml"),
                      ["buffer.sampler.type=priority", "buffer.sampler.reuse_decay=0.25"])
    assert (cfg.buffer.sampler.type, cfg.buffer.sampler.reuse_decay) == ("priority", 0.25)


def test_override_does_not_leak_through_yaml_aliases(tmp_path):
    path = write(tmp_path, "explorer: &shared\n  steps: 3\ntrainer: *shared\n")
    assert (load_config(path).explorer.steps, load_config(path).trainer.steps) == (3, 3)
    cfg = load_config(path, ["trainer.steps=5"])
    assert (cfg.explorer.steps, cfg.trainer.steps) == (3, 5)


# --- error messages -------------------------------------------------------------------------


def test_config_error_is_a_user_error():
    assert issubclass(ConfigError, UserError)


def test_unknown_key_names_file_key_line_and_suggestion(tmp_path):
    path = write(tmp_path, "run:\n  name: x\ntrainer:\n  lrr: 0.1\n")
    error = problems_of(path)
    (problem,) = error.problems
    assert (problem.key, problem.line) == ("trainer.lrr", 4)
    assert str(error) == f"{path}:4: trainer.lrr: unknown key; did you mean 'lr'?"


def test_unknown_key_without_close_match_lists_allowed_keys(tmp_path):
    error = problems_of(write(tmp_path, "synchronizer:\n  sync_interval: 2\n"))
    assert "synchronizer: unknown key; allowed keys: run, mode, model, buffer" in str(error)


def test_unknown_key_that_belongs_to_another_section(tmp_path):
    error = problems_of(write(tmp_path, "trainer:\n  max_staleness: 2\n"))
    assert "trainer.max_staleness: unknown key; did you mean 'buffer.max_staleness'?" in str(error)


def test_unknown_key_inside_a_sampler_variant(tmp_path):
    path = write(tmp_path, "buffer:\n  sampler:\n    type: priority\n    reuse_decayy: 0.1\n"
                 "    weights: {a: 1}\n")
    error = problems_of(path)
    lines = str(error).splitlines()[1:]
    assert lines == [
        f"  {path}:4: buffer.sampler.reuse_decayy: unknown key; did you mean 'reuse_decay'?",
        f"  {path}:5: buffer.sampler.weights: unknown key; allowed keys: type, reuse_decay",
    ]


def test_unknown_sampler_type_and_missing_variant_field(tmp_path):
    path = write(tmp_path, "buffer:\n  sampler:\n    type: prio\n")
    assert str(problems_of(path)) == (
        f"{path}:3: buffer.sampler.type: expected one of 'fifo', 'priority', 'mixture', "
        "got 'prio'; did you mean 'priority'?")
    path = write(tmp_path, "buffer:\n  sampler: {type: mixture}\n")
    assert str(problems_of(path)) == (
        f"{path}:2: buffer.sampler.weights: required key is missing")


@pytest.mark.parametrize(("text", "key", "expected"), [
    ("trainer:\n  batch_size: many\n", "trainer.batch_size", "expected an integer, got 'many'"),
    ("trainer:\n  batch_size: 1.5\n", "trainer.batch_size", "expected an integer, got 1.5"),
    ("trainer:\n  lr: fast\n", "trainer.lr", "expected a number, got 'fast'"),
    ("buffer:\n  fsync: maybe\n", "buffer.fsync", "expected true or false, got 'maybe'"),
    ("explorer: 3\n", "explorer", "expected a mapping, got 3"),
    ("run:\n  name: [a, b]\n", "run.name", "expected a string, got a list"),
    ("run:\n  name: off\n", "run.name",
     "expected a string, got false; put it in quotes to mean text"),
    ("buffer:\n  sampler: fifo\n", "buffer.sampler", "expected a mapping, got 'fifo'"),
    ("mode: bth\n", "mode",
     "expected one of 'both', 'train', 'explore', 'bench', got 'bth'; did you mean 'both'?"),
    ("explorer:\n  count: 0\n", "explorer.count", "must be >= 1, got 0"),
    ("sync:\n  timeout: 0\n", "sync.timeout", "must be > 0.0, got 0"),
    ("run:\n  name: my run\n", "run.name", "must start with a letter or digit"),
])
def test_wrong_values_name_key_and_expectation(tmp_path, text, key, expected):
    path = write(tmp_path, text)
    (problem,) = problems_of(path).problems
    assert problem.key == key
    assert problem.message.startswith(expected)
    assert problem.line == text.count("\n", 0, text.index(key.split(".")[-1] + ":")) + 1


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    error = problems_of(missing)
    assert str(error).startswith(f"{missing}: config file not found")


def test_folder_instead_of_file(tmp_path):
    assert str(problems_of(tmp_path)) == f"{tmp_path}: is a folder, not a config file"


def test_yaml_syntax_error_has_line_and_column(tmp_path):
    path = write(tmp_path, "trainer:\n  lr: [1\nmode: both\n")
    (problem,) = problems_of(path).problems
    assert (problem.line, problem.column) == (3, 5)
    assert str(problem).startswith(f"{path}:3:5: invalid YAML: ")


def test_several_documents_are_rejected(tmp_path):
    error = problems_of(write(tmp_path, "mode: both\n---\nmode: train\n"))
    assert "expected a single document" in str(error)


@pytest.mark.parametrize("text", ["- a\n- b\n", "just text\n", "3\n"])
def test_top_level_must_be_a_mapping(tmp_path, text):
    error = problems_of(write(tmp_path, text))
    assert "the top level must be a mapping of sections" in str(error)


def test_duplicate_keys_are_reported(tmp_path):
    path = write(tmp_path, "trainer:\n  lr: 0.1\n  lr: 0.2\n")
    assert str(problems_of(path)) == (
        f"{path}:3: trainer.lr: duplicate key (first on line 2); only one may be given")


@pytest.mark.parametrize(("override", "expected"), [
    ("trainer.lr", "expected KEY=VALUE with a dotted key"),
    ("=3", "expected KEY=VALUE with a dotted key"),
    ("trainer..lr=3", "expected KEY=VALUE with a dotted key"),
    ("trainer.lr=[1", "the value is not valid YAML"),
    ("mode.x=1", "cannot set mode.x: mode is 'both', not a mapping"),
])
def test_malformed_override(tmp_path, override, expected):
    path = write(tmp_path, "mode: both\n")
    (problem,) = problems_of(path, [override]).problems
    assert problem.override == override
    assert str(problem) == f"{path}: --set {override}: {problem.message}"
    assert problem.message.startswith(expected)


def test_problem_from_an_override_names_it_instead_of_a_line(tmp_path):
    path = write(tmp_path, "trainer:\n  lr: 0.1\n")
    (problem,) = problems_of(path, ["trainer.lrr=1"]).problems
    assert problem.line is None
    assert str(problem) == (
        f"{path}: trainer.lrr (from --set trainer.lrr=1): unknown key; did you mean 'lr'?")
    (problem,) = problems_of(path, ["trainer.lr=-1"]).problems
    assert str(problem) == f"{path}: trainer.lr (from --set trainer.lr=-1): must be > 0.0, got -1"


def test_start_weights_must_be_a_published_version(tmp_path):
    start = tmp_path / "other" / "weights" / "v000040"
    path = write(tmp_path, f"model:\n  start_weights: {start}\n")
    (problem,) = problems_of(path).problems
    assert (problem.key, problem.line) == ("model.start_weights", 2)
    assert "is not a published weights version" in problem.message
    start.mkdir(parents=True)
    (start / "manifest.json").write_text("{}")
    assert load_config(path).model.start_weights == start


def test_model_path_must_exist(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, "model:\n  dtype: float32\n  path: models/tiny\n")
    (problem,) = problems_of(path).problems
    assert (problem.key, problem.line) == ("model.path", 3)
    assert "'models/tiny' does not exist" in problem.message
    assert str(tmp_path) in problem.message  # where a relative path was looked for
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    assert load_config(path).model.path == Path("models/tiny")
    (problem,) = problems_of(path, [f"model.path={path}"]).problems
    assert problem.override == f"model.path={path}"
    assert "is a file" in problem.message


def test_grpo_needs_groups_of_rollouts(tmp_path):
    path = write(tmp_path, "explorer:\n  repeat: 1\n")
    (problem,) = problems_of(path).problems
    assert (problem.key, problem.line) == ("explorer.repeat", 2)
    assert "needs repeat >= 2" in problem.message
    assert load_config(path, ["mode=train"]).explorer.repeat == 1
    assert load_config(path, ["algorithm.algorithm_type=ppo"]).explorer.repeat == 1


def test_every_problem_is_reported_together(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, "\n".join([
        "mode: bth",               # 1
        "trainer:",                # 2
        "  lrr: 0.1",              # 3
        "  steps: x",              # 4
        "explorer:",               # 5
        "  count: 0",              # 6
        "model:",                  # 7
        "  path: no/such/model",   # 8
        "",
    ]))
    error = problems_of(path, ["sync.methd=nccl", "oops"])
    assert [(p.key, p.line, p.override) for p in error.problems] == [
        ("mode", 1, None), ("trainer.lrr", 3, None), ("trainer.steps", 4, None),
        ("explorer.count", 6, None), ("model.path", 8, None),
        ("", None, "oops"), ("sync.methd", None, "sync.methd=nccl"),
    ]
    lines = str(error).splitlines()
    assert lines[0] == "7 problems in the config:"
    assert lines[1:] == [f"  {p}" for p in error.problems]
    assert all(line.startswith(f"  {path}") for line in lines[1:])


# --- one name per setting -----------------------------------------------------------------

RENAMED_CASES = [  # (file, old key, its line, the new name the message gives)
    ("trainer:\n  lr: 1.0e-5\n  algorithm: sft\n", "trainer.algorithm", 3,
     "algorithm.algorithm_type"),
    ("trainer:\n  clip_ratio: 0.3\n", "trainer.clip_ratio", 2,
     "algorithm.policy_loss_fn_args.clip_range"),
    ("trainer:\n  kl_coef: 0.05\n", "trainer.kl_coef", 2,
     "algorithm.kl_loss_fn_args.kl_coef (with kl_loss_fn: k3)"),
    ("algorithm:\n  policy_loss_fn_args: {loss_agg_mode: token-mean}\n",
     "algorithm.policy_loss_fn_args.loss_agg_mode", 2, "algorithm.loss_agg_mode"),
]


@pytest.mark.parametrize(("text", "old", "line", "new"), RENAMED_CASES,
                         ids=[case[1] for case in RENAMED_CASES])
def test_an_old_name_is_refused_with_its_new_name(tmp_path, text, old, line, new):
    path = write(tmp_path, text)
    (problem,) = problems_of(path).problems
    assert (problem.key, problem.line) == (old, line)
    assert str(problem) == f"{path}:{line}: {old}: was renamed to {new}; write that instead"


def test_every_old_name_is_tested():
    assert {tuple(case[1].split(".")) for case in RENAMED_CASES} == set(RENAMED)


def test_an_old_name_in_a_stage_or_an_override_names_the_new_one(tmp_path):
    path = write(tmp_path, "stages:\n  - name: warm\n    trainer: {algorithm: sft}\n"
                           "  - name: rl\n")
    (problem,) = problems_of(path).problems
    assert (problem.key, problem.line) == ("stages[0].trainer.algorithm", 3)
    assert problem.message == ("was renamed to stages[0].algorithm.algorithm_type; "
                               "write that instead")
    (problem,) = problems_of(write(tmp_path, ""), ["trainer.kl_coef=0.1"]).problems
    assert (problem.key, problem.override) == ("trainer.kl_coef", "trainer.kl_coef=0.1")
    assert problem.message.startswith("was renamed to algorithm.kl_loss_fn_args.kl_coef")


def test_an_old_name_does_not_hide_the_other_problems(tmp_path):
    path = write(tmp_path, "trainer:\n  algorithm: sft\n  lr: -1\n")
    error = problems_of(path)
    assert [(p.key, p.line) for p in error.problems] == [("trainer.algorithm", 2),
                                                         ("trainer.lr", 3)]
    assert "renamed" in error.problems[0].message and "must be > 0" in error.problems[1].message


# --- schema docs ----------------------------------------------------------------------------


def test_every_field_of_the_schema_has_a_docstring():
    models = [m for m in vars(schema).values() if isinstance(m, type)
              and issubclass(m, BaseModel) and m.__module__ == schema.__name__]
    assert schema.ExperimentConfig in models
    undocumented = [f"{m.__name__}.{name}" for m in models
                    for name, field in m.model_fields.items() if not field.description]
    assert undocumented == []


def test_docs_config_reference_is_up_to_date():
    page = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert splice(page, render_reference()) == page, (
        "docs/config.md is stale: run python -m rft_hpc.config.reference docs/config.md")


def test_reference_lists_every_key():
    text = render_reference()
    for section in ("run", "model", "explorer", "trainer", "sync"):
        model = type(getattr(ExperimentConfig(), section))
        for name in model.model_fields:
            key = f"{section}.{name}"  # a row, or a section of its own (explorer.vllm)
            assert f"| `{key}` |" in text or f"### `{key}`" in text
    assert "### `buffer.sampler` with `type: fifo` (the default)" in text


# --- rft-hpc validate, as a real process -----------------------------------------------------


def rft_hpc(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rft_hpc.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_cli_validate_ok():
    result = rft_hpc("validate", "configs/demo.yaml", "--set", "trainer.lr=3e-5")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        "OK: configs/demo.yaml (mode=both, 2 explorer(s), trainer grpo)")


def test_cli_validate_reports_every_problem_without_traceback(tmp_path):
    path = write(tmp_path, "trainer:\n  lrr: 0.1\nexplorer:\n  count: 0\n")
    result = rft_hpc("validate", str(path), "--set", "sync.method=tcp")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert f"{path}:2: trainer.lrr: unknown key; did you mean 'lr'?" in result.stderr
    assert f"{path}:4: explorer.count: must be >= 1, got 0" in result.stderr
    assert "sync.method (from --set sync.method=tcp)" in result.stderr


def test_cli_validate_refuses_an_old_name_in_one_message(tmp_path):
    path = write(tmp_path, "trainer:\n  algorithm: sft\n")
    result = rft_hpc("validate", str(path))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert (f"{path}:2: trainer.algorithm: was renamed to algorithm.algorithm_type"
            in " ".join(result.stderr.split()))
    assert result.stderr.count("renamed") == 1 and "unknown key" not in result.stderr


@pytest.mark.parametrize("args", [
    ["validate", "no/such/config.yaml"],
    ["validate", "."],
    ["validate", "configs/demo.yaml", "--set", "trainer.lr"],
    ["validate"],
    ["validate", "configs/demo.yaml", "--bogus"],
])
def test_cli_validate_fails_cleanly(args):
    result = rft_hpc(*args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip()


def test_cli_prints_messages_with_brackets_literally():
    # `[/]` and `[bold]` would be rich markup: the message must come out as written.
    result = rft_hpc("validate", "configs/demo.yaml", "--set", "x[/]", "--set", "y[bold]")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "--set x[/]: expected KEY=VALUE" in result.stderr
    assert "--set y[bold]: expected KEY=VALUE" in result.stderr
