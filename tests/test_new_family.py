"""Adding a family needs no change to the package: one registered from a test module goes through
preprocess, pack, write and a training step, every stage asking the registry."""

from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest
import torch

from helpers import REPO, vlmshard
from hf_reference import hf_loss_and_grads, make_folder, make_shards
from vlmshard.io import read_json
from vlmshard.shards.loader import ShardDataset


@pytest.mark.slow
def test_a_family_registered_outside_the_package_goes_through_every_stage(tmp_path):
    folder = make_folder("internvl", str(tmp_path / "model"))
    # The built-in family, in this process: the reference for ids, labels, tiles and the loss.
    (tmp_path / "builtin").mkdir()
    builtin = make_shards(folder, tmp_path / "builtin", target_samples=3, micro_batches=2)

    env = {**os.environ, "VLMSHARD_FAMILIES": "renamed_family",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.path.join(REPO, "tests"),
                                                       os.environ.get("PYTHONPATH")]))}
    root = tmp_path / "renamed"
    pre, plan, shards, run = (str(root / n) for n in ("pre", "plan", "shards", "run"))
    vlmshard("preprocess", str(tmp_path / "builtin" / "rows.jsonl"), "--out", pre, "--model",
             folder, "--workers", "1", env=env)
    vlmshard("pack", "--stats", pre, "--dp", "1", "--target-samples", "3", "--micro-batches",
             "2", "--out", plan, env=env)
    vlmshard("write", "--plan", plan, "--stats", pre, "--out", shards, "--workers", "1", env=env)
    vlmshard("train", "--shards", shards, "--pp", "2", "--max-steps", "1", "--lr", "0.001",
             "--warmup-steps", "0", "--max-grad-norm", "0", "--out", run, env=env)

    assert read_json(os.path.join(pre, "preprocess.json"))["config"]["model"]["family"] == \
        "renamed_internvl"
    assert read_json(os.path.join(shards, "manifest.json"))["model"]["family"] == \
        "renamed_internvl"
    columns = ["image_tiles", "vit_tiles", "text_tokens", "seq_len", "loss_tokens"]
    assert pq.read_table(os.path.join(pre, "stats"), columns=columns).to_pylist() == \
        pq.read_table(os.path.join(tmp_path, "builtin", "pre", "stats"),
                      columns=columns).to_pylist()
    # The same records byte for byte: the same ids, labels and images.
    assert [s["sha256"] for s in read_json(os.path.join(shards, "manifest.json"))["shards"]] == \
        [s["sha256"] for s in read_json(os.path.join(builtin, "manifest.json"))["shards"]]

    # The step trained the transformers model exactly: its loss is the model's own.
    batches = list(ShardDataset(builtin, pixel_dtype=torch.float32))[:2]
    loss, count, _ = hf_loss_and_grads(folder, batches, tokens_per_tile=256, rows_per_tile=1)
    with open(os.path.join(run, "train_log.jsonl"), encoding="utf-8") as f:
        logged = json.loads(f.readline())
    assert logged["loss"] == pytest.approx(loss / count, rel=1e-5)
