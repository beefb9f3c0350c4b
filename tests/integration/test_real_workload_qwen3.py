"""test_real_workload.py's tests (its docstring says what they check and the regime they
run) on the Qwen3 family: the same tests, imported, with this module's `FAMILY`. A file of
its own, so that under `--dist loadfile` the two families' runs, the suite's longest, go on
two test workers at once."""

from test_real_workload import (  # noqa: F401  (collected here with this module's FAMILY)
    test_grpo_raises_held_out_accuracy_beyond_noise,
    test_the_export_answers_as_the_run,
    test_vllm_loads_the_export_and_agrees_on_logprobs,
    workload,
)

FAMILY = "qwen3"
