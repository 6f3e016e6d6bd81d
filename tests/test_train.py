"""Training on real shards with DeepSpeed's pipeline engine: 2 local processes, gloo on CPU."""

from __future__ import annotations

import json
import os
import statistics

import pytest
from PIL import Image

from helpers import vlmshard
from vlmshard.packing.plan import PackConfig, run_pack
from vlmshard.preprocess import PreprocessConfig, run_preprocess
from vlmshard.shards.loader import ShardDataset
from vlmshard.shards.writer import WriteConfig, run_write
from vlmshard.train.partition import LayerCost, stage_memory
from vlmshard.train.profile import ProfileConfig, run_profile
from vlmshard.simulate.runs import validate_against_log
from vlmshard.io import read_json

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


@pytest.fixture(scope="module")
def partition(small_shards, tmp_path_factory) -> str:
    """A profiled partition for 2 stages whose memory budget forces some recompute."""
    out = tmp_path_factory.mktemp("profile")
    run_profile(ProfileConfig(shards=small_shards, out=str(out), pp=2, micro_batches=2,
                              memory_budget="1TB"))
    layers = [LayerCost(**c) for c in read_json(out / "profile.json")["layers"]]
    n = len(layers)
    # Just under what the best partition needs without recompute: every choice must recompute.
    tight = min(max(stage_memory(layers, 0, cut, 2, []), stage_memory(layers, cut, n, 1, []))
                for cut in range(1, n)) - 1
    run_profile(ProfileConfig(shards=small_shards, out=str(out), pp=2, micro_batches=2,
                              memory_budget=tight))
    return str(out / "partition.json")


def test_profile_calibrates_and_recomputes_to_fit(partition, small_shards, tmp_path):
    chosen = read_json(partition)
    budget = chosen["machine"]["memory_budget"]
    search = chosen["search"]
    assert all(s["memory_bytes"] <= budget for s in search["stages"])
    assert any(s["recompute"] for s in search["stages"])
    for other in ("parameters", "uniform"):
        if chosen[other] is not None:
            assert search["max_stage_s"] <= chosen[other]["max_stage_s"] + 1e-12
    folder = os.path.dirname(partition)
    profile = read_json(os.path.join(folder, "profile.json"))
    assert [layer["name"] for layer in profile["layers"]][-1] == "head"
    assert all(layer["forward_s"] > 0 and layer["activation_bytes"] >= 0
               for layer in profile["layers"])
    plan = tmp_path / "plan"
    vlmshard("pack", "--stats", os.path.join(os.path.dirname(small_shards), "pre"), "--dp", "2",
             "--cost-model", os.path.join(folder, "cost_model.json"), "--out", str(plan))
    assert read_json(plan / "plan.json")["cost_model"]["origin"].startswith("file:")


@pytest.mark.slow
def test_validate_top_trains_each_candidate_and_chooses_the_fastest(small_shards, tmp_path):
    out = tmp_path / "profile"
    vlmshard("train", "profile", "--config", CONFIG, "--shards", small_shards, "--pp", "2",
             "--micro-batches", "2", "--validate-top", "2", "--validate-steps", "3",
             "--out", str(out))
    partitions = read_json(out / "partition.json")
    validated = partitions["validated"]
    assert [p["name"] for p in validated] == ["search", partitions["omnibal"][0]["name"]]
    for candidate in validated:
        run = out / "validate" / candidate["name"]
        assert read_json(run / "train_config.json")["bounds"] == candidate["bounds"]
        times = [r["step_time_s"] for r in _log(run / "train_log.jsonl")]
        assert len(times) == 3 and not (run / "checkpoints").exists()
        assert candidate["measured_step_s"] == pytest.approx(statistics.median(times[1:]))
    assert partitions["chosen"] == min(validated, key=lambda p: p["measured_step_s"])


def _log(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _plan_samples(shards: str, rank: int, world: int) -> list[list[int]]:
    return [[s["sample_id"] for s in r.samples]
            for r in ShardDataset(shards, rank, world).records()]


@pytest.mark.slow
def test_pipeline_of_two_stages_learns_from_its_plan(small_shards, partition, tmp_path):
    """The searched partition, with its per-stage recompute, trains on DeepSpeed's engine."""
    vlmshard("train", "--config", CONFIG, "--shards", small_shards, "--pp", "2", "--dp", "1",
             "--max-steps", "20", "--lr", "0.003", "--partition", partition,
             "--out", str(tmp_path / "run"))
    config = read_json(tmp_path / "run" / "train_config.json")
    assert config["bounds"] == read_json(partition)["chosen"]["bounds"] and config["recompute"]
    log = _log(tmp_path / "run" / "train_log.jsonl")
    assert [r["step"] for r in log] == list(range(20))
    first, last = (sum(r["loss"] for r in part) / 5 for part in (log[:5], log[-5:]))
    assert last < first - 1.0, (first, last)
    plan = _plan_samples(small_shards, 0, 1)
    seen = [ids for r in log for ids in r["data"][0]["sample_ids"]]
    stages = {r["stage"] for r in log[-1]["ranks"]}
    assert stages == {0, 1} and all(r["forward_s"] > 0 and r["backward_s"] > 0
                                    for r in log[-1]["ranks"])
    assert seen == [plan[i % len(plan)] for i in range(len(seen))]
    # The simulator replays this run's logged steps with the run's own partition. Live CPU
    # timings on a shared machine swing 2x (CI's runs gave -37% and -52%), so accuracy is held
    # on a recorded run instead (test_simulate); here every step is replayed.
    check = validate_against_log(str(tmp_path / "run" / "train_log.jsonl"),
                                 os.path.dirname(partition))
    assert [s["step"] for s in check["per_step"]] == list(range(1, 20))
    assert all(s["predicted_s"] > 0 for s in check["per_step"])


@pytest.mark.slow
def test_two_data_parallel_ranks_learn_from_exactly_their_plan(small_shards, tmp_path):
    """20 steps over a 6-step plan: each rank reads its own shards, epoch after epoch."""
    vlmshard("train", "--config", CONFIG, "--shards", small_shards, "--pp", "1", "--dp", "2",
             "--max-steps", "20", "--lr", "0.003", "--out", str(tmp_path / "run"))
    log = _log(tmp_path / "run" / "train_log.jsonl")
    assert [r["step"] for r in log] == list(range(20))
    first, last = (sum(r["loss"] for r in part) / 5 for part in (log[:5], log[-5:]))
    assert last < first - 1.0, (first, last)
    for rank in range(2):
        plan = _plan_samples(small_shards, rank, 2)
        seen = [ids for r in log for ids in r["data"][rank]["sample_ids"]]
        assert len(seen) > len(plan) and seen == [plan[i % len(plan)] for i in range(len(seen))]


@pytest.mark.slow
def test_resume_continues_the_loss_trajectory_exactly(small_shards, tmp_path):
    common = ["--config", CONFIG, "--shards", small_shards, "--pp", "2", "--lr", "0.003"]
    vlmshard("train", *common, "--max-steps", "6", "--out", str(tmp_path / "straight"))
    vlmshard("train", *common, "--max-steps", "3", "--out", str(tmp_path / "stopped"))
    vlmshard("train", *common, "--max-steps", "6", "--resume", str(tmp_path / "stopped"))
    straight = _log(tmp_path / "straight" / "train_log.jsonl")
    resumed = _log(tmp_path / "stopped" / "train_log.jsonl")
    assert [r["step"] for r in resumed] == list(range(6))
    assert [r["data"] for r in resumed] == [r["data"] for r in straight]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in straight],
                                                         rel=1e-5)
