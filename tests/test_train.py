"""Training on real shards with DeepSpeed's pipeline engine: 2 local processes, gloo on CPU."""

from __future__ import annotations

import json
import os

import pytest
from PIL import Image

from helpers import vlmshard
from packing.plan import PackConfig, run_pack
from preprocess import PreprocessConfig, run_preprocess
from shards.loader import ShardDataset
from shards.writer import WriteConfig, run_write

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                      "train-tiny.yaml")


@pytest.fixture(scope="module")
def small_shards(demo, tmp_path_factory):
    """24 short single-tile conversations through the real stages, packed for 2 ranks."""
    root = tmp_path_factory.mktemp("small")
    photo = next(p for p in demo.images if p.endswith(".jpg"))
    with Image.open(os.path.join(demo.root, photo)) as im:
        im.convert("RGB").resize((448, 448)).save(root / "photo.jpg")
    with open(root / "small.jsonl", "w") as f:
        for i in range(24):
            f.write(json.dumps({"image": "photo.jpg", "conversations": [
                {"from": "human", "value": f"<image>\nWhat is shown, item {i % 4}?"},
                {"from": "gpt", "value": f"A photo of item {i % 4}."}]}) + "\n")
    run_preprocess(PreprocessConfig(inputs=[str(root / "small.jsonl")], out=str(root / "pre"),
                                    keep_tokens=True, workers=1))
    run_pack(PackConfig(stats=str(root / "pre"), dp=2, out=str(root / "plan"), target_samples=2))
    run_write(WriteConfig(plan=str(root / "plan"), stats=str(root / "pre"), out=str(root / "s"),
                          workers=1))
    return str(root / "s")


def _log(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _plan_samples(shards: str, rank: int, world: int) -> list[list[int]]:
    return [[s["sample_id"] for s in r.samples]
            for r in ShardDataset(shards, rank, world).records()]


@pytest.mark.slow
def test_pipeline_of_two_stages_learns_from_its_plan(small_shards, tmp_path):
    vlmshard("train", "--config", CONFIG, "--shards", small_shards, "--pp", "2", "--dp", "1",
             "--max-steps", "20", "--lr", "0.003", "--out", str(tmp_path / "run"))
    log = _log(tmp_path / "run" / "train_log.jsonl")
    assert [r["step"] for r in log] == list(range(20))
    first, last = (sum(r["loss"] for r in part) / 5 for part in (log[:5], log[-5:]))
    assert last < first - 1.0, (first, last)
    plan = _plan_samples(small_shards, 0, 1)
    seen = [ids for r in log for ids in r["sample_ids"]]
    assert seen == [plan[i % len(plan)] for i in range(len(seen))]


@pytest.mark.slow
def test_two_data_parallel_ranks_see_exactly_their_plan(small_shards, tmp_path):
    steps = ShardDataset(small_shards, 0, 2).steps
    vlmshard("train", "--config", CONFIG, "--shards", small_shards, "--pp", "1", "--dp", "2",
             "--max-steps", str(steps), "--out", str(tmp_path / "run"))
    logs = [_log(tmp_path / "run" / name) for name in ("train_log.jsonl", "train_log-dp1.jsonl")]
    for rank, log in enumerate(logs):
        assert [ids for r in log for ids in r["sample_ids"]] == _plan_samples(small_shards, rank, 2)
    assert [r["loss"] for r in logs[0]] == pytest.approx([r["loss"] for r in logs[1]])
