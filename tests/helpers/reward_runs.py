"""The small run that the tests of rewards from models score: one-digit sums with a tiny
model, two trainer steps of 8 rollouts, the reward given by the test (a weighted list of a
function, reward models and judges, as YAML list entries)."""

from __future__ import annotations

from pathlib import Path


def reward_run_config(tmp_path: Path, name: str, model: Path, reward: list[str], *,
                      explorer: str = "count: 1, tasks_per_step: 2", extra: str = "") -> Path:
    """Write `tmp_path/exp.yaml`: run `name` under `tmp_path/runs` on `model`, its tasks'
    reward the entries of `reward` (each the YAML of one list entry), the explorer's
    `explorer` keys besides 4 rollouts of up to 4 tokens (failed rewards never stop it),
    2 trainer steps of 8, no held-out evaluation between, `extra` top-level YAML appended."""
    entries = "".join(f"    - {entry}\n" for entry in reward)
    config = tmp_path / "exp.yaml"
    config.write_text(f"""\
run: {{name: {name}, root: {tmp_path / 'runs'}}}
model: {{path: {model}}}
tasks:
  type: arithmetic
  digits: 1
  eval_size: 4
  reward:
{entries}explorer: {{{explorer}, repeat: 4, max_new_tokens: 4, reward_failure_limit: 1.0}}
trainer: {{steps: 2, batch_size: 8}}
eval: {{interval: 0, max_new_tokens: 4}}
sync: {{method: checkpoint, interval: 1, offset: 1}}
{extra}""")
    return config
