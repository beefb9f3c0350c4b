"""Generated preference data with a hidden gold rule, for reward-model recipes on CPUs
(docs/reward-models.md).

Prompts are `Describe the <topic>.`; responses are a few lower-case ASCII words ending in
`.`, drawn from a small vocabulary of good, bad and neutral words (and the topic). The gold
rule (`gold_score`) scores a response: +1 per distinct good word, -1 per distinct bad word,
+1 when it names the prompt's topic. Preference rows in WebGPT's comparisons layout carry
two responses and their gold scores, from which a reward model learns the rule without
seeing it; `gold_reward` scores rollouts with the rule itself, so that a policy trained on a
learned reward model can be checked against the truth. A repeated good word does not pay
under the rule: a policy that repeats one to please a learned reward model is hacking it.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from rft_hpc.config.tasks import GOLD_REWARD
from rft_hpc.tasks.task import Task

TOPICS = ("cat", "dog", "bird", "horse", "tree", "flower", "garden", "forest", "river",
          "lake", "ocean", "mountain", "cloud", "road", "bridge", "house", "school",
          "market", "city", "train")
"""The topics of the prompts, none of them a word of the vocabularies below."""

EVAL_TOPICS = TOPICS[-4:]
"""The topics of the held-out tasks of `describe_tasks` (never in a training task)."""

TRAIN_TOPICS = TOPICS[:-4]
"""The topics of the training tasks of `describe_tasks`."""

GOOD_WORDS = ("kind", "clear", "bright", "calm", "warm", "gentle", "fresh", "clean",
              "sweet", "soft")
"""Words worth +1 each under the gold rule (once per response, however often repeated)."""

BAD_WORDS = ("rude", "dull", "ugly", "harsh", "dirty", "loud", "sour", "grim", "weak",
             "cruel")
"""Words worth -1 each under the gold rule (once per response)."""

NEUTRAL_WORDS = ("the", "a", "is", "it", "and", "very", "quite", "looks", "big", "small",
                 "old", "new", "tall", "round", "green")
"""Words worth nothing under the gold rule."""

MIN_WORDS, MAX_WORDS = 3, 8
"""How many words a generated response has."""

_PROMPT = re.compile(r"\s*Describe the ([a-z]+)\.\s*")
_WORD = re.compile(r"[a-z]+")


def describe_prompt(topic: str) -> str:
    """The prompt asking to describe `topic`: `Describe the <topic>.`."""
    return f"Describe the {topic}."


def prompt_topic(prompt: str) -> str | None:
    """The topic that `prompt` asks to describe (`Describe the <topic>.`, lower-case ASCII
    letters), or None when the prompt is not of that form."""
    match = _PROMPT.fullmatch(prompt)
    return match.group(1) if match else None


def response_words(response: str) -> list[str] | None:
    """The words of `response` when it is readable by the gold rule: after stripping
    surrounding whitespace and one final `.`, one or more lower-case ASCII words separated
    by whitespace. None for an empty response or any other character."""
    text = response.strip()
    text = text[:-1] if text.endswith(".") else text
    words = text.split()
    if not words or not all(_WORD.fullmatch(w) for w in words):
        return None
    return words


def gold_score(prompt: str, response: str) -> float:
    """The gold rule: +1 per distinct word of `GOOD_WORDS` in `response`, -1 per distinct
    word of `BAD_WORDS`, +1 when the topic of `prompt` (see `prompt_topic`) is one of its
    words; 0.0 for a response `response_words` cannot read. Repeating a word changes
    nothing. Deterministic: the same arguments always score the same."""
    words = response_words(response)
    if words is None:
        return 0.0
    distinct = set(words)
    topic = prompt_topic(prompt)
    return float(len(distinct.intersection(GOOD_WORDS)) - len(distinct.intersection(BAD_WORDS))
                 + (topic is not None and topic in distinct))


def gold_reward(task: Task, response: str) -> float:
    """The reward-function form of `gold_score` (`fn(task, response)`, docs/rewards.md): the
    task's prompt (with chat messages, the last user message) holds the topic."""
    prompt = task.prompt
    if task.messages:
        prompt = next((m["content"] for m in reversed(task.messages) if m["role"] == "user"),
                      "")
    return gold_score(prompt, response)


def random_response(rng: random.Random, topic: str) -> str:
    """A response of `MIN_WORDS`..`MAX_WORDS` words drawn by `rng` with replacement (so a
    word may repeat) from the good, bad and neutral words and `topic`, ending in `.`."""
    pools = (GOOD_WORDS, BAD_WORDS, NEUTRAL_WORDS, (topic,))
    words = [rng.choice(rng.choices(pools, weights=(3, 3, 3, 1))[0])
             for _ in range(rng.randint(MIN_WORDS, MAX_WORDS))]
    return " ".join(words) + "."


def preference_rows(n: int, seed: int = 0) -> list[dict[str, str | float]]:
    """`n` rows in WebGPT's comparisons layout: `question` (`Describe the <topic>.`, the
    topic drawn from `TOPICS`), two different responses `answer_0` and `answer_1`, and their
    gold scores `score_0` and `score_1`. Some rows are ties (equal scores). The same `n` and
    `seed` always give the same rows."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"rft-hpc preferences {seed}")
    rows: list[dict[str, str | float]] = []
    for _ in range(n):
        topic = rng.choice(TOPICS)
        prompt = describe_prompt(topic)
        first = random_response(rng, topic)
        second = random_response(rng, topic)
        while second == first:
            second = random_response(rng, topic)
        rows.append({"question": prompt, "answer_0": first, "answer_1": second,
                     "score_0": gold_score(prompt, first),
                     "score_1": gold_score(prompt, second)})
    return rows


def write_preference_file(path: Path, n: int, seed: int = 0) -> Path:
    """Write `preference_rows(n, seed)` to `path`: Parquet when its suffix is `.parquet`,
    else JSONL (one row a line); returns `path`. Read it back with
    `data: {source: file, kind: dpo, layout: webgpt}`."""
    rows = preference_rows(n, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def describe_tasks(train_size: int = 5000, eval_size: int = 500,
                   seed: int = 0) -> tuple[list[Task], list[Task]]:
    """(train, eval): `train_size` tasks `Describe the <topic>.` on topics of
    `TRAIN_TOPICS` drawn by a seeded RNG, and `eval_size` on the held-out `EVAL_TOPICS` in
    turn, so that no prompt is in both lists; the same arguments always give the same lists.
    Each task's answer is its topic, its reward the gold rule (`gold_reward`), its task set
    `describe`."""
    rng = random.Random(f"rft-hpc describe {seed}")

    def task(task_id: str, topic: str) -> Task:
        return Task(task_id=task_id, prompt=describe_prompt(topic), answer=topic,
                    reward=GOLD_REWARD, taskset="describe")
    train = [task(f"describe-{i}", rng.choice(TRAIN_TOPICS)) for i in range(train_size)]
    held_out = [task(f"describe-eval-{i}", EVAL_TOPICS[i % len(EVAL_TOPICS)])
                for i in range(eval_size)]
    return train, held_out
