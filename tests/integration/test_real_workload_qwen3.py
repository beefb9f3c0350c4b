"""test_real_workload.py's tests (its docstring says what they check and the regime they
run) on the Qwen3 family: the same tests, imported, with this module's `FAMILY`. A file of
its own, so that under `--dist loadfile` the two families' runs, the suite's longest, go on
two test workers at once.

Marked `long` (`.venv/bin/python -m pytest -m long tests/integration/test_real_workload_qwen3.py`):
the suite was over its 25 minutes on CI (27:03 of pytest, 2026-12-08) and this file is its
costliest (~280 CPU-s of the ~3400 that tools/suite_cpu.py attributed to tests); the Qwen3
family's template, tokenizer, weights and conversion stay in the suite (test_model_families,
test_chat_templates, test_megatron, test_chat_multiturn), and the same regime on Qwen2 runs
in test_real_workload.py."""

import pytest
from test_real_workload import (  # noqa: F401  (collected here with this module's FAMILY)
    test_grpo_raises_held_out_accuracy_beyond_noise,
    test_the_export_answers_as_the_run,
    test_vllm_loads_the_export_and_agrees_on_logprobs,
    workload,
)

FAMILY = "qwen3"

pytestmark = pytest.mark.long
