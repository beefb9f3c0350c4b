"""Loading an experiment config: YAML file, `--set` overrides, validation, checks.

Every problem is collected before anything is raised, so that one `ConfigError` names them
all, each with the file, the dotted key and the line of the file (or the `--set` it came
from).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import yaml
from pydantic import ValidationError

from rft_hpc.config.algorithm import GROUP_ADVANTAGE_TYPES
from rft_hpc.config.errors import ConfigError, Problem
from rft_hpc.config.explain import Key, describe, dotted, explain
from rft_hpc.config.placement import colocate_refusals
from rft_hpc.config.renamed import take_renamed
from rft_hpc.config.schema import ExperimentConfig
from rft_hpc.core.retry import read_bytes

Check = Callable[[ExperimentConfig], Iterator[tuple[tuple[Key, ...], str]]]
"""A check of a validated config: yields (key path, problem) for each thing wrong."""

OVERRIDE_EXAMPLE = "trainer.lr=1e-5"


def load_config(
    path: str | os.PathLike[str], overrides: Sequence[str] = (),
    checks: Sequence[tuple[frozenset[str], Check]] = (),
) -> ExperimentConfig:
    """Read the YAML config at `path`, apply the `KEY=VALUE` overrides and validate it.

    An empty file gives all defaults. Each override sets one dotted key (`trainer.lr=1e-5`)
    to a YAML value (`buffer.sampler={type: priority}`), creating the sections on its way.
    On any problem (missing or unreadable file, bad YAML, malformed override, unknown key,
    a setting's old name, wrong type or value, `model.path` that does not exist) raises
    `ConfigError` naming every problem found, each with its key and line; never returns a
    partly valid config. `checks` are more checks like `CHECKS`, from layers above this one
    (`rft_hpc.tasks.preflight`: the rewards import and take their arguments); their
    problems are reported the same way, with key and line.
    """
    path = Path(path)
    source = _Source(path, _read(path))
    problems = list(source.duplicate_keys())
    problems += [Problem(path, message, override=text)
                 for text, message in source.apply_overrides(overrides)]
    problems += [source.problem(keys, message) for keys, message in take_renamed(source.data)]
    config, failed, invalid = _validate(source)
    problems += invalid
    problems += _run_checks(source, config, failed, (*CHECKS, *checks))
    if problems:
        problems.sort(key=lambda p: (p.line is None, p.line or 0))
        raise ConfigError(problems)
    assert config is not None
    return config


def _read(path: Path) -> str:
    try:  # checks and read in one, with retries (`core.retry`)
        return read_bytes(path, what="config").decode("utf-8")
    except FileNotFoundError:
        raise ConfigError([Problem(path, f"config file not found{_looked_in(path)}")]) from None
    except IsADirectoryError:
        raise ConfigError([Problem(path, "is a folder, not a config file")]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            [Problem(path, f"not UTF-8 text ({exc.reason} at byte {exc.start})")]
        ) from None
    except OSError as exc:
        raise ConfigError([Problem(path, f"cannot read the file: {exc.strerror}")]) from None


def _looked_in(path: Path) -> str:
    """Where a relative path was looked for (the current directory), for not-found messages."""
    return "" if path.is_absolute() else f" (looked in {Path.cwd()})"


class _Source:
    """The parsed file: its data, its YAML node tree (for line numbers) and the overrides."""

    def __init__(self, path: Path, text: str) -> None:
        self.path = path
        self.node, data = _parse_yaml(path, text)
        if data is None:
            data = {}
        if not isinstance(data, dict):
            fields = ", ".join(ExperimentConfig.model_fields)
            raise ConfigError([Problem(
                path, f"the top level must be a mapping of sections ({fields}), "
                f"got {describe(data)}", line=self.node.start_mark.line + 1 if self.node else None,
            )])
        self.data: dict[object, object] = data
        self.overrides: list[tuple[tuple[str, ...], str]] = []

    def apply_overrides(self, overrides: Sequence[str]) -> Iterator[tuple[str, str]]:
        """Apply each override to `data`; yields (override, problem) for those that cannot be."""
        for text in overrides:
            key, sep, raw = text.partition("=")
            key = re.sub(r"\[(\d+)\]", r".\1", key)  # stages[0].x is stages.0.x
            keys = tuple(part.strip() for part in key.split("."))
            if not sep or not all(keys):
                yield text, f"expected KEY=VALUE with a dotted key, e.g. {OVERRIDE_EXAMPLE}"
                continue
            try:
                value = yaml.safe_load(raw)
            except yaml.YAMLError as exc:
                yield text, f"the value is not valid YAML: {getattr(exc, 'problem', exc)}"
                continue
            problem = _set_path(self.data, keys, value)
            if problem:
                yield text, problem
            else:
                self.overrides.append((keys, text))

    def problem(self, keys: Sequence[Key], message: str) -> Problem:
        """A problem at `keys`, placed on the line of the file or at the override it came from."""
        line, exact = self.line(keys)
        override = self._override_of(tuple(keys), exact)
        if override is not None:
            return Problem(self.path, message, key=dotted(keys), override=override)
        return Problem(self.path, message, key=dotted(keys), line=line)

    def line(self, keys: Sequence[Key]) -> tuple[int | None, bool]:
        """1-based line of the deepest key of `keys` in the file, and whether all were found."""
        node, line = self.node, None
        for key in keys:
            child = _child_node(node, key)
            if child is None:
                return line, False
            line, node = child[0].start_mark.line + 1, child[1]
        return line, True

    def duplicate_keys(self) -> Iterator[Problem]:
        """A problem for each key written twice in one mapping (YAML would keep the last)."""
        for keys, first, again in _duplicates(self.node, (), set()):
            yield Problem(self.path, f"duplicate key (first on line {first}); only one may "
                          "be given", key=dotted(keys), line=again)

    def _override_of(self, keys: tuple[Key, ...], in_file: bool) -> str | None:
        for set_keys, text in reversed(self.overrides):
            if keys[:len(set_keys)] == set_keys:
                return text  # the value at `keys` is (inside) what the override set
            if not in_file and set_keys[:len(keys)] == keys:
                return text  # the override created `keys` on its way
        return None


def _parse_yaml(path: Path, text: str) -> tuple[yaml.Node | None, object]:
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        return node, (loader.construct_document(node) if node is not None else None)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        context = f"{exc.context}, " if exc.context else ""
        raise ConfigError([Problem(
            path, f"invalid YAML: {context}{exc.problem}",
            line=mark.line + 1 if mark else None, column=mark.column + 1 if mark else None,
        )]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([Problem(path, f"invalid YAML: {exc}")]) from None
    finally:
        loader.dispose()


def _set_path(data: dict[object, object], keys: tuple[str, ...], value: object) -> str | None:
    """Set `data[k1][k2]...` = value, creating (or copying, to unshare YAML aliases) the
    mappings on the way; a numeric key indexes an existing list (`stages.0.trainer.lr`).
    Returns a problem instead when the path cannot be followed."""
    here: object = data
    for depth, key in enumerate(keys, start=1):
        prefix = dotted(keys[:depth - 1])
        last = depth == len(keys)
        if isinstance(here, list):
            if not key.isdigit() or int(key) >= len(here):
                return (f"cannot set {dotted(keys)}: {prefix} is a list of {len(here)}; "
                        f"use an index 0..{len(here) - 1}")
            index = int(key)
            here[index] = below = value if last else _unshared(here[index])
        elif isinstance(here, dict):
            here[key] = below = value if last else _unshared(here.get(key))
        else:
            return f"cannot set {dotted(keys)}: {prefix} is {describe(here)}, not a mapping"
        here = below
    return None


def _unshared(below: object) -> object:
    """The value on the way to a key being set: `{}` for a missing or null one, a copy of a
    mapping or a list (YAML aliases may share it with another path), else itself."""
    if below is None:
        return {}
    if isinstance(below, dict | list):
        return type(below)(below)
    return below


def _child_node(node: yaml.Node | None, key: Key) -> tuple[yaml.Node, yaml.Node] | None:
    """The (key node, value node) of entry `key` of a mapping or sequence node (last wins)."""
    if isinstance(node, yaml.MappingNode):
        found = [(k, v) for k, v in node.value
                 if isinstance(k, yaml.ScalarNode) and k.value == str(key)]
        return found[-1] if found else None
    if isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
        item = node.value[key]
        return item, item
    return None


def _duplicates(
    node: yaml.Node | None, keys: tuple[Key, ...], seen: set[int]
) -> Iterator[tuple[tuple[Key, ...], int, int]]:
    """(key path, first line, repeated line) of each repeated key under `node`."""
    if node is None or id(node) in seen:  # aliases may make the node tree cyclic
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for key_node, value_node in node.value:
            name = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if name is None or name == "<<":
                continue
            line = key_node.start_mark.line + 1
            if name in first:
                yield (*keys, name), first[name], line
            first.setdefault(name, line)
            yield from _duplicates(value_node, (*keys, name), seen)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            yield from _duplicates(item, (*keys, index), seen)


def _validate(source: _Source) -> tuple[ExperimentConfig | None, set[Key] | None, list[Problem]]:
    """The validated config (None if invalid), the top-level keys that failed (None when the
    config failed as a whole) and a problem for every validation error."""
    try:
        return ExperimentConfig.model_validate(source.data), set(), []
    except ValidationError as exc:
        errors = exc.errors()
    problems = [source.problem(*explain(ExperimentConfig, error)) for error in errors]
    if any(not error["loc"] for error in errors):
        return None, None, problems
    return None, {error["loc"][0] for error in errors}, problems


def _run_checks(
    source: _Source, config: ExperimentConfig | None, failed: set[Key] | None,
    checks: Sequence[tuple[frozenset[str], Check]],
) -> list[Problem]:
    """Run each check whose sections all validated (on a config with the failed sections
    left at their defaults, so that their problems are still reported alongside)."""
    if failed is None:
        return []
    if config is None:
        kept = {k: v for k, v in source.data.items() if k not in failed}
        try:
            config = ExperimentConfig.model_validate(kept)
        except ValidationError:
            return []
    return [source.problem(keys, message)
            for sections, check in checks if not sections & failed
            for keys, message in check(config)]


def _model_path_exists(config: ExperimentConfig) -> Iterator[tuple[tuple[Key, ...], str]]:
    path = config.model.path
    if path is None or (config.model.init is not None and not path.exists()):
        return  # a missing folder with `init` set is built by the run
    if not path.exists():
        yield ("model", "path"), f"model folder {str(path)!r} does not exist{_looked_in(path)}"
    elif not path.is_dir():
        yield ("model", "path"), f"{str(path)!r} is a file; expected a Hugging Face model folder"


def _start_weights_are_published(config: ExperimentConfig,
                                 ) -> Iterator[tuple[tuple[Key, ...], str]]:
    start = config.model.start_weights
    if start is None:
        return
    # manifest.json: what a published version holds (docs/weights-format.md; sync/ is a
    # layer above this one)
    if not re.fullmatch(r"v\d+", start.name) or not (start / "manifest.json").is_file():
        yield ("model", "start_weights"), (
            f"{str(start)!r} is not a published weights version (a weights/v<N> folder of a "
            f"run, with its manifest.json){_looked_in(start)}")


def _grpo_needs_groups(config: ExperimentConfig) -> Iterator[tuple[tuple[Key, ...], str]]:
    for index, (_, stage) in enumerate(config.stage_configs()):
        where: tuple[Key, ...] = ("stages", index) if config.stages else ()
        algorithm = stage.algorithm.algorithm_type
        if stage.mode == "both" and algorithm in GROUP_ADVANTAGE_TYPES \
                and stage.explorer.repeat < 2:
            yield (*where, "explorer", "repeat"), (
                f"{algorithm} compares the rollouts of one task with each other, so it needs "
                f"repeat >= 2, got {stage.explorer.repeat}")


def _dynamic_sampling_is_single_turn(config: ExperimentConfig,
                                     ) -> Iterator[tuple[tuple[Key, ...], str]]:
    for index, (_, stage) in enumerate(config.stage_configs()):
        where: tuple[Key, ...] = ("stages", index) if config.stages else ()
        if stage.pipeline.dynamic_sampling.enabled and stage.explorer.workflow.type != \
                "single_turn":
            yield (*where, "pipeline", "dynamic_sampling", "enabled"), (
                "dynamic sampling draws tasks into a streaming single-turn step; the "
                f"{stage.explorer.workflow.type} workflow does not stream: use "
                "over_rollout there, or a reward_std_filter in pipeline.experience_filters")


def _remax_is_single_turn(config: ExperimentConfig) -> Iterator[tuple[tuple[Key, ...], str]]:
    for index, (_, stage) in enumerate(config.stage_configs()):
        where: tuple[Key, ...] = ("stages", index) if config.stages else ()
        if stage.mode == "both" and stage.algorithm.uses_greedy_baseline() \
                and stage.explorer.workflow.type != "single_turn":
            yield (*where, "explorer", "workflow", "type"), (
                "remax's baseline is the reward of one greedy response per prompt, which the "
                f"single-turn workflow generates; the {stage.explorer.workflow.type} workflow "
                "does not")


def _reward_model_trains_on_pairs(config: ExperimentConfig,
                                  ) -> Iterator[tuple[tuple[Key, ...], str]]:
    for index, (_, stage) in enumerate(config.stage_configs()):
        where: tuple[Key, ...] = ("stages", index) if config.stages else ()
        if stage.algorithm.algorithm_type != "reward_model":
            continue
        if stage.mode != "train":
            yield (*where, "mode"), (
                f"a reward model trains on preference pairs in mode train, not {stage.mode}")
        elif stage.data is None or stage.data.kind != "dpo":
            yield (*where, "data", "kind"), (
                "a reward model trains on preference pairs: set data.kind dpo (a prompt, "
                "the response chosen and the one rejected)")
        if stage.model.lora is not None:
            yield (*where, "model", "lora"), "a reward model trains the whole model, no LoRA"
        if stage.trainer.backend != "torch" or stage.trainer.parallel != "ddp":
            yield (*where, "trainer", "backend"), (
                "a reward model trains with trainer.backend torch and parallel ddp (a whole "
                "replica per rank)")


def _reward_stages_come_first(config: ExperimentConfig,
                              ) -> Iterator[tuple[tuple[Key, ...], str]]:
    if not config.stages and config.algorithm.algorithm_type == "reward_model":
        return  # a reward-model stage's own config: it trains, and never scores with it
    reward = config.tasks.reward
    terms = list(enumerate(reward)) if isinstance(reward, list) else [(None, reward)]
    kinds = [(name, stage.algorithm.algorithm_type) for name, stage in config.stage_configs()]
    for i, term in terms:
        name = getattr(term, "stage", None)
        if name is None:
            continue
        key = ("tasks", "reward", *(() if i is None else (i,)), "stage")
        index = next((j for j, (n, _) in enumerate(kinds) if n == name), None)
        if not config.stages or index is None:
            yield key, (f"no stage named {name!r} in this run" +
                        (f" (stages: {', '.join(n for n, _ in kinds)})" if config.stages
                         else " (it has no stages)"))
        elif kinds[index][1] != "reward_model":
            yield key, f"stage {name!r} trains {kinds[index][1]}, not a reward model"
        elif any(kind != "reward_model" for _, kind in kinds[:index]):
            yield key, (f"stage {name!r} must come before every stage that is not a reward "
                        "model: those score with the tasks' reward, which it does not give "
                        "before it finishes")


CHECKS: tuple[tuple[frozenset[str], Check], ...] = (
    (frozenset({"model"}), _model_path_exists),
    (frozenset({"model"}), _start_weights_are_published),
    (frozenset({"mode", "trainer", "explorer", "stages"}), _grpo_needs_groups),
    (frozenset({"explorer", "pipeline", "stages"}), _dynamic_sampling_is_single_turn),
    (frozenset({"algorithm", "mode", "explorer", "stages"}), _remax_is_single_turn),
    (frozenset({"algorithm", "mode", "data", "model", "trainer", "stages"}),
     _reward_model_trains_on_pairs),
    (frozenset({"tasks", "stages"}), _reward_stages_come_first),
    (frozenset({"launch", "mode", "explorer", "trainer", "sync", "stages"}),
     colocate_refusals),
)
"""Checks beyond the schema, each with the top-level sections it reads."""
