"""The `rft-hpc` command as a user runs it: real subprocesses, exit codes, messages."""

import json
import random
import subprocess
import sys

import pytest

from rft_hpc import __version__
from rft_hpc.buffer import Experience, SegmentWriter
from rft_hpc.models.tokenizer import build_char_tokenizer


def rft(*args, cwd=None):
    """Run `rft-hpc ARGS` in a fresh interpreter; returns the CompletedProcess."""
    return subprocess.run([sys.executable, "-m", "rft_hpc.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def assert_user_error(result, *fragments):
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr + result.stdout
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """A buffer like a run's: two explorer writers, plus SFT and DPO data imported by the CLI."""
    out = tmp_path_factory.mktemp("demo") / "run"
    tokenizer = build_char_tokenizer(out / "tokenizer")
    rng = random.Random(0)
    for e in range(2):
        writer = SegmentWriter(out / "buffer", f"explorer-{e}", "rl")
        for step in range(5):
            writer.write_step(step, [
                Experience(tokens=[rng.randrange(4, 100) for _ in range(12)], prompt_length=6,
                           reward=float(rng.random() < 0.5), group_id=step, policy_version=step,
                           step=step) for _ in range(8)])
    sums = [(rng.randrange(10, 100), rng.randrange(10, 100)) for _ in range(256)]
    sft = out / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "response": str(a + b)}) + "\n"
                           for a, b in sums))
    dpo = out / "dpo.jsonl"
    dpo.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "chosen": str(a + b),
                                       "rejected": str(a + b + 1)}) + "\n"
                           for a, b in sums[:64]))
    for src, kind in ((sft, "sft"), (dpo, "dpo")):
        result = rft("buffer", "import", src, "--kind", kind, "--out", out / "buffer",
                     "--tokenizer", tokenizer)
        assert result.returncode == 0, result.stderr
    return out, tokenizer


def test_version_and_help():
    assert rft("--version").stdout.strip() == f"rft-hpc {__version__}"
    result = rft("--help")
    assert result.returncode == 0
    for command in ("run", "buffer", "validate", "model"):
        assert command in result.stdout


def test_inspect_json_reports_every_writer(demo_run):
    out, _ = demo_run
    result = rft("buffer", "inspect", out / "buffer", "--json")
    assert result.returncode == 0, result.stderr
    rows = {w["writer"]: w for w in json.loads(result.stdout)["writers"]}
    assert set(rows) == {"explorer-0", "explorer-1", "import-sft", "import-dpo"}
    assert rows["explorer-0"]["records"] == 40 and rows["explorer-0"]["kinds"] == ["rl"]
    assert rows["explorer-0"]["policy_versions"] == [0, 4]
    assert rows["import-sft"]["records"] == 256
    table = rft("buffer", "inspect", out / "buffer")
    assert "explorer-1" in table.stdout and "reward" in table.stdout


def test_import_export_verify_from_the_command_line(tmp_path, demo_run):
    out, _ = demo_run
    src = tmp_path / "rl.jsonl"
    src.write_text('{"prompt": "1+2=", "response": "3", "reward": 1}\n'
                   '{"prompt": "1+2=", "response": "4", "reward": 0}\n')
    buf = tmp_path / "buf"
    result = rft("buffer", "import", src, "--kind", "rl", "--out", buf,
                 "--tokenizer", out / "tokenizer")
    assert result.returncode == 0, result.stderr
    assert "imported 2 rl record(s)" in result.stdout
    result = rft("buffer", "export", buf, "--out", tmp_path / "back.jsonl")
    assert result.returncode == 0, result.stderr
    lines = [json.loads(x) for x in (tmp_path / "back.jsonl").read_text().splitlines()]
    assert [x["reward"] for x in lines] == [1.0, 0.0]
    result = rft("buffer", "verify", buf)
    assert result.returncode == 0 and "OK" in result.stdout

    segment = buf / "import-rl" / "00000000.h5"
    segment.write_bytes(segment.read_bytes()[:1000])
    assert_user_error(rft("buffer", "verify", buf), "corrupt", "00000000.h5")
    fixed = rft("buffer", "verify", buf, "--fix")
    assert fixed.returncode == 0, fixed.stderr
    assert (buf / "quarantine" / "import-rl" / "00000000.h5.reason.txt").exists()


def test_a_malformed_import_line_is_one_message_and_writes_nothing(tmp_path, demo_run):
    out, _ = demo_run
    src = tmp_path / "sft.jsonl"
    src.write_text('{"prompt": "1+2=", "response": "3"}\n{"prompt": "1+2=", "respons": "3"}\n')
    result = rft("buffer", "import", src, "--kind", "sft", "--out", tmp_path / "buf",
                 "--tokenizer", out / "tokenizer")
    assert_user_error(result, "line 2", "respons", "nothing imported")
    assert not (tmp_path / "buf" / "import-sft").exists()


@pytest.mark.parametrize(("args", "fragments"), [
    (["buffer", "inspect", "{tmp}"], ["is not an rft-hpc buffer"]),
    (["buffer", "verify", "{tmp}/nope"], ["does not exist"]),
    (["buffer", "export", "{tmp}/nope", "--out", "{tmp}/x.jsonl"], ["does not exist"]),
    (["buffer", "export", "{tmp}", "--out", "{tmp}/no/x.jsonl"], ["does not exist"]),
    (["buffer", "import", "{tmp}/missing.jsonl", "--kind", "sft", "--out", "{tmp}/b"],
     ["missing.jsonl does not exist"]),
    (["buffer", "import", "{tmp}/f.jsonl", "--kind", "ppo", "--out", "{tmp}/b"],
     ["unknown kind 'ppo'"]),
    (["buffer", "import", "{tmp}/f.jsonl", "--kind", "sft", "--out", "{tmp}/b",
      "--tokenizer", "{tmp}/notok"], ["notok does not exist"]),
    (["model", "init", "tiny", "--arch", "gpt2", "--out", "{tmp}/m"],
     ["unknown --arch 'gpt2'", "llama, qwen2, qwen3, mistral"]),
    (["model", "init", "huge", "--out", "{tmp}/m"], ["unknown model 'huge'"]),
    (["buffer", "inspect"], ["Missing argument"]),
    (["buffer", "frobnicate"], ["No such command"]),
])
def test_bad_input_gives_one_clear_message(tmp_path, args, fragments):
    (tmp_path / "f.jsonl").write_text('{"prompt": "a", "response": "b"}\n')
    result = rft(*[a.format(tmp=tmp_path) for a in args])
    assert_user_error(result, *fragments)


def test_model_init_builds_a_family_chat_model(tmp_path):
    result = rft("model", "init", "tiny", "--arch", "qwen2", "--out", tmp_path / "m")
    assert result.returncode == 0, result.stderr
    assert "tiny qwen2 chat model written to" in result.stdout
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["tie_word_embeddings"]
    tokenizer = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tokenizer["chat_template"]
    assert_user_error(rft("model", "init", "tiny", "--out", tmp_path / "m"), "is not empty")
