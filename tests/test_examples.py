"""The examples of training on the shards outside ``vlmshard train`` run (``--smoke``) and agree:
each one's first-step loss equals the Ave-Token loss computed here from the HF model run on each
sample alone (``hf_reference``), and ``own_loop.py --check`` finds packed and alone logits
equal for an InternVL and a Qwen2-VL folder."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import REPO
from hf_reference import split_samples, supervised

EXAMPLES = os.path.join(REPO, "examples")
pytestmark = pytest.mark.slow


def _run(script: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), *args],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{\"")]


@pytest.fixture(scope="module")
def first_step_loss(tmp_path_factory) -> float:
    """Step 0 of the smoke shards (every virtual rank, world size 1): Σ per-sample HF losses
    over their supervised tokens. The smoke set-up makes the same bytes every time."""
    from transformers import AutoModelForImageTextToText

    sys.path.insert(0, EXAMPLES)
    from common import smoke_setup

    from vlmshard.shards.loader import ShardDataset

    folder, shards = smoke_setup(str(tmp_path_factory.mktemp("smoke")))
    data = ShardDataset(shards, pad_to_caps=False)
    step0 = [b for _, b in zip(range(data.micro_batches_per_step), data)]
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32,
                                                        attn_implementation="sdpa").eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in step0:
            for sample in split_samples(batch, model.config.image_token_id, 256, 1):
                n = supervised(sample)
                total += float(model(**sample, use_cache=False).loss) * n
                count += n
    return total / count


def test_own_loop(first_step_loss):
    steps = _json_lines(_run("own_loop.py", "--smoke"))
    assert [s["step"] for s in steps] == [0, 1]
    assert steps[0]["loss"] == pytest.approx(first_step_loss, rel=1e-4)


def test_hf_trainer(first_step_loss):
    logs = [ast.literal_eval(line[line.index("{'loss'"):].split("}")[0] + "}")
            for line in _run("hf_trainer.py", "--smoke").replace("\r", "\n").splitlines()
            if "{'loss'" in line]
    assert len(logs) == 2
    assert float(logs[0]["loss"]) == pytest.approx(first_step_loss, abs=1e-3)  # logged as %.4g


def test_accelerate_loop(first_step_loss):
    steps = _json_lines(_run("accelerate_loop.py", "--smoke"))
    assert [s["step"] for s in steps] == [0, 1]
    assert steps[0]["loss"] == pytest.approx(first_step_loss, rel=1e-4)


@pytest.mark.parametrize("family", ["internvl", "qwen2_vl"])
def test_own_loop_check_finds_packed_equal_to_alone(family):
    (result,) = _json_lines(_run("own_loop.py", "--smoke", "--check", "--family", family))
    assert result["samples"] >= 2
    assert result["max_abs_diff"] <= 1e-4
