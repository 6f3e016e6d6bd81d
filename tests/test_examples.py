"""The examples of training on the shards outside ``vlmshard train`` run and agree, on image
shards (``--smoke``: the demo's Hub-style source, a tiny InternVL) and on video shards (MP4, MKV
and frame-list clips with a tiny Qwen2.5-VL, as tests/test_video.py makes them): each one's
first-step loss equals the Ave-Token loss computed here from the HF model run on each sample
alone (``hf_reference``), ``own_loop.py --check`` finds packed and alone logits equal, and a
run leaves nothing in the temporary folder and no warning about the loss."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch
from helpers import REPO
from hf_reference import make_folder, make_shards, split_samples, supervised

EXAMPLES = os.path.join(REPO, "examples")
pytestmark = pytest.mark.slow


def _run(script: str, *args: str) -> str:
    """The example's stdout; it must succeed, leave no folder of its own in the temporary
    folder (TMPDIR) and convert no loss that requires grad to a float (torch's warning)."""
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), *args],
                              capture_output=True, text=True, timeout=900,
                              env={**os.environ, "TMPDIR": tmp})
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert [n for n in os.listdir(tmp) if n.startswith("vlmshard-")] == []
    assert "tensor.detach()" not in proc.stderr
    return proc.stdout


def _json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{\"")]


def _first_step_loss(folder: str, shards: str) -> float:
    """Step 0 of the shards (every virtual rank, world size 1): Σ per-sample HF losses over
    their supervised tokens."""
    from transformers import AutoModelForImageTextToText

    from vlmshard.shards.loader import ShardDataset

    data = ShardDataset(shards, pad_to_caps=False)
    step0 = [b for _, b in zip(range(data.micro_batches_per_step), data)]
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32,
                                                        attn_implementation="sdpa").eval()
    config = model.config
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in step0:
            for sample in split_samples(batch, config.image_token_id, 256, 1,
                                        getattr(config, "video_token_id", None)):
                n = supervised(sample)
                total += float(model(**sample, use_cache=False).loss) * n
                count += n
    return total / count


@pytest.fixture(scope="module", params=["images", "videos"])
def setup(request, tmp_path_factory) -> tuple[list[str], float]:
    """(the examples' arguments, their first step's loss computed here). Images: ``--smoke``'s
    model and shards, made once here for every example (``--smoke`` makes them in each run:
    10 s of CPU; ``test_own_loop_check_on_a_qwen2_vl_smoke`` runs it); videos: shards made
    here."""
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "images":
        sys.path.insert(0, EXAMPLES)
        from common import smoke_setup

        folder, shards = smoke_setup(str(root))
    else:
        folder = make_folder("qwen2_5_vl", str(root / "model"))
        shards = make_shards(folder, root, rows="videos", target_samples=2)
    return ["--model", folder, "--shards", shards], _first_step_loss(folder, shards)


def test_own_loop(setup):
    args, first_step_loss = setup
    steps = _json_lines(_run("own_loop.py", *args))
    assert [s["step"] for s in steps] == [0, 1]
    assert steps[0]["loss"] == pytest.approx(first_step_loss, rel=1e-4)


def test_hf_trainer(setup):
    args, first_step_loss = setup
    logs = [ast.literal_eval(line[line.index("{'loss'"):].split("}")[0] + "}")
            for line in _run("hf_trainer.py", *args).replace("\r", "\n").splitlines()
            if "{'loss'" in line]
    assert len(logs) == 2
    assert float(logs[0]["loss"]) == pytest.approx(first_step_loss, abs=1e-3)  # logged as %.4g


def test_hf_trainer_on_the_recipe_users_run(setup):
    """The Trainer on LLaMA-Factory's default recipe (the vision tower and projector frozen,
    LoRA on the LLM, through PEFT): its first step's loss is the full model's, since LoRA's B
    starts at zero, and only the adapters train."""
    args, first_step_loss = setup
    out = _run("hf_trainer.py", *args, "--train", "llm", "--lora-rank", "4")
    logs = [ast.literal_eval(line[line.index("{'loss'"):].split("}")[0] + "}")
            for line in out.replace("\r", "\n").splitlines() if "{'loss'" in line]
    assert len(logs) == 2
    assert float(logs[0]["loss"]) == pytest.approx(first_step_loss, abs=1e-3)  # logged as %.4g
    assert "trainable params:" in out and "trainable%" in out


def test_accelerate_loop(setup):
    args, first_step_loss = setup
    steps = _json_lines(_run("accelerate_loop.py", *args))
    assert [s["step"] for s in steps] == [0, 1]
    assert steps[0]["loss"] == pytest.approx(first_step_loss, rel=1e-4)


def test_own_loop_check_finds_packed_equal_to_alone(setup):
    (result,) = _json_lines(_run("own_loop.py", *setup[0], "--check"))
    assert result["samples"] >= 2
    assert result["max_abs_diff"] <= 1e-4


def test_own_loop_check_on_a_qwen2_vl_smoke():
    (result,) = _json_lines(_run("own_loop.py", "--smoke", "--check", "--family", "qwen2_vl"))
    assert result["samples"] >= 2
    assert result["max_abs_diff"] <= 1e-4
