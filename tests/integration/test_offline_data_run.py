"""Offline SFT, then DPO, from the user's Parquet file with its own column names, end to end
through `rft-hpc run`: the imported records hold the chat prompt's ids and the responses,
and each stage trains on them."""

from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.parquet as pq
from helpers.chat_models import chat_model
from helpers.runs import rft
from transformers import AutoTokenizer

from rft_hpc.buffer.records import DPOPair, SFTSample
from rft_hpc.buffer.segment import read_segment
from rft_hpc.monitor.metrics import read_metrics

ROWS = 48
CONFIG = """\
run: {{name: offline, root: {root}}}
model: {{path: {model}}}
prompt: {{format: chat}}
tasks: {{type: arithmetic, eval_size: 4}}
eval: {{max_new_tokens: 3}}
mode: train
buffer: {{max_uses: 2}}
trainer: {{steps: 6, batch_size: 16, lr: 1.0e-3, save_interval: 6}}
stages:
  - name: sft
    algorithm: {{algorithm_type: sft}}
    buffer: {{max_uses: 3}}
    data: {{source: file, path: {data}, rows: [8, 48], kind: sft,
            keys: {{prompt: question, response: solution, task_id: qid}}}}
  - name: dpo
    algorithm: {{algorithm_type: dpo}}
    data: {{source: file, path: {data}, kind: dpo,
            keys: {{prompt: question, chosen: solution, rejected: wrong}}}}
"""


def _trained(stage, name):
    return [r[name] for r in read_metrics(stage / "metrics" / "trainer.jsonl") if name in r]


def test_sft_then_dpo_from_a_parquet_file_with_its_own_column_names(tmp_path):
    model = chat_model(tmp_path / "qwen2", "qwen2")
    tok = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    numbers = range(10, 10 + ROWS)
    pq.write_table(pa.table({"qid": [f"q{a}" for a in numbers],
                             "question": [f"{a}+{a}=" for a in numbers],
                             "solution": [str(2 * a) for a in numbers],
                             "wrong": [str(2 * a + 1) for a in numbers],
                             "origin": ["generated"] * ROWS}), tmp_path / "expert.parquet")
    config = tmp_path / "offline.yaml"
    config.write_text(CONFIG.format(root=tmp_path / "runs", model=model,
                                    data=tmp_path / "expert.parquet"))
    result = rft("run", config, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    stages = tmp_path / "runs" / "offline" / "stages"

    sft = read_segment(stages / "0-sft" / "buffer" / "import-data" / "00000000.h5").records()
    assert len(sft) == 40 and all(isinstance(r, SFTSample) for r in sft)
    first = sft[0]
    prompt = tok.apply_chat_template([{"role": "user", "content": "18+18="}], tokenize=False,
                                     add_generation_prompt=True)
    assert tok.decode(first.tokens[:first.prompt_length]) == prompt
    assert tok.decode(first.tokens[first.prompt_length:]) == "36<|im_end|>"
    assert first.response_mask.tolist() == [0] * first.prompt_length + [1, 1, 1]
    assert (first.task_id, first.taskset, first.info) == ("q18", "expert",
                                                          {"wrong": "37", "origin": "generated"})
    losses = _trained(stages / "0-sft", "sft_loss")
    assert len(losses) == 6 and losses[-1] < losses[0], losses

    pairs = read_segment(stages / "1-dpo" / "buffer" / "import-data" / "00000000.h5").records()
    assert len(pairs) == ROWS and all(isinstance(p, DPOPair) for p in pairs)
    p = pairs[-1].prompt_length
    assert tok.decode(pairs[-1].chosen_tokens[p:]) == f"{2 * 57}<|im_end|>"
    assert tok.decode(pairs[-1].rejected_tokens[p:]) == f"{2 * 57 + 1}<|im_end|>"
    dpo = _trained(stages / "1-dpo", "dpo_loss")
    assert len(dpo) == 6 and math.isclose(dpo[0], math.log(2), rel_tol=1e-3), dpo
    assert dpo[-1] < dpo[0] and _trained(stages / "1-dpo", "accuracy_mean")[-1] > 0.5, dpo
