"""Grouped plans end to end: packing groups of sequence-parallel degrees 1, 2 and 4 written to
shards, each rank reading its share, and trained by DeepSpeed over 4 CPU processes (gloo): every
step's loss equals the ``transformers`` model's on that step's samples, one at a time, at the
weights the step started from; ZeRO-2 and ZeRO-3 train to the same losses as ZeRO-1, and a run
killed with -9 resumes to them."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import kill_9_when, vlmshard, vlmshard_here
from hf_reference import ROWS, clip_rows, hf_loss_and_grads, make_folder

from vlmshard.errors import ConfigError
from vlmshard.packing.config import PackConfig
from vlmshard.packing.plan import run_pack
from vlmshard.preprocess import PreprocessConfig, run_preprocess
from vlmshard.shards.config import WriteConfig
from vlmshard.shards.layout import read_manifest
from vlmshard.shards.loader import ShardDataset
from vlmshard.shards.records import decoded_images
from vlmshard.shards.sequence import media_pieces, share
from vlmshard.shards.writer import run_write
from vlmshard.train.hf_model import model_layers
from vlmshard.train.sequence_parallel import check_model

DP = 4
COMMON = ["--pp", "1", "--dp", str(DP), "--lr", "0.003", "--lr-scheduler-type", "constant"]


@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    """Tiny Qwen2-VL shards of short chats and the image rows (up to 202 tokens), packed in
    groups of 64 (SP 1), 128 (SP 2) and 256 tokens (SP 4) for one rank's 64 tokens."""
    root = tmp_path_factory.mktemp("grouped")
    folder = make_folder("qwen2_vl", str(root / "model"))
    rows = ROWS * 2 + [{"conversations": [
        {"from": "human", "value": f"Say {i}"}, {"from": "gpt", "value": f"Number {i}."}]}
        for i in range(16)]
    with open(root / "rows.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    run_preprocess(PreprocessConfig(inputs=[str(root / "rows.jsonl")], out=str(root / "pre"),
                                    model=folder, workers=1))
    run_pack(PackConfig(stats=str(root / "pre"), dp=DP, out=str(root / "plan"),
                        groups="64,128,256", max_qt=64, max_qv=64))
    run_write(WriteConfig(plan=str(root / "plan"), stats=str(root / "pre"),
                          out=str(root / "shards"), workers=1))
    return folder, str(root / "shards")


def test_each_rank_takes_its_share_at_any_world_size_dividing_the_virtual_ranks(grouped,
                                                                               tmp_path):
    """Shards planned for 8 virtual ranks, read by 4 and by 8 ranks: in a step of SP degree s,
    the ranks of a group (consecutive ranks) take the same micro-batches, rank w share w mod s,
    and the world takes every micro-batch of the step exactly once per share."""
    plan, shards = str(tmp_path / "plan"), str(tmp_path / "shards")
    root = read_manifest(grouped[1]).stats["path"]  # the preprocess output
    run_pack(PackConfig(stats=root, dp=DP, virtual_ranks=8, out=plan, groups="64,128,256",
                        max_qt=64, max_qv=64))
    run_write(WriteConfig(plan=plan, stats=root, out=shards, workers=1))
    manifest = read_manifest(shards)
    for world in (4, 8):
        taken = {}  # (step, rank) -> the records' (virtual rank, micro), in order
        for w in range(world):
            for r in ShardDataset(shards, w, world).records():
                taken.setdefault((r.step, w), []).append((r.rank, r.micro))
        for step in range(manifest.steps):
            sp = manifest.step_group(step)["sp"]
            whole = set()
            for w in range(world):
                mine = taken[(step, w)]
                assert len(mine) == manifest.micro_batches * 8 // world
                assert {v % sp for v, _ in mine} == {w % sp}  # its share
                # the same micro-batches as the group's first rank
                first = taken[(step, w - w % sp)]
                assert [(v // sp, m) for v, m in mine] == [(v // sp, m) for v, m in first]
                whole |= {(v // sp, m, v % sp) for v, m in mine}
            assert whole == {(d, m, j) for d in range(8 // sp)
                             for m in range(manifest.micro_batches) for j in range(sp)}


def _log(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _whole_steps(shards: str) -> list[list[dict]]:
    """Each step's whole micro-batches: a step of SP degree s is read from the ranks w with
    w mod s = 0, one for each of its data-parallel ranks."""
    manifest = read_manifest(shards)
    steps: list[list[dict]] = [[] for _ in range(manifest.steps)]
    for w in range(DP):
        data = ShardDataset(shards, w, DP, pixel_dtype=torch.float32)
        for record in data.records():
            if w % manifest.step_group(record.step)["sp"] == 0:
                steps[record.step].append(data.collate(record, share=False))
    return steps


@pytest.mark.slow(minutes=4)
def test_sequence_parallel_steps_train_as_the_hf_model_at_each_zero_stage_and_resume(grouped,
                                                                                    tmp_path,
                                                                                    capfd):
    folder, shards = grouped
    manifest = read_manifest(shards)
    degrees = [manifest.step_group(t)["sp"] for t in range(manifest.steps)]
    assert set(degrees[:5]) == {1, 2, 4}
    steps = 5  # SP 1, 2 and 4 among them
    common = [*COMMON, "--shards", shards, "--max-steps", str(steps)]
    straight = tmp_path / "straight"
    vlmshard_here("train", *common, "--checkpoint-every", "1", "--out", str(straight))
    log = _log(straight / "train_log.jsonl")
    assert [r["sp"] for r in log] == degrees[:steps]
    # every step's loss is the HF model's per-token mean over the step's samples, at the
    # weights the step started from (the model folder, then each checkpoint's)
    model = model_layers(folder)
    for step, batches in enumerate(_whole_steps(shards)[:steps]):
        weights = folder if step == 0 else str(straight / "checkpoints" / f"step-{step}" / "hf")
        total, tokens, _ = hf_loss_and_grads(weights, batches, model.geometry.tokens_per_tile,
                                             model.geometry.pixel_rows_per_tile)
        assert log[step]["loss"] == pytest.approx(total / tokens, rel=1e-5), (step,
                                                                              degrees[step])
    # ZeRO-3 (every weight split, gathered as each layer runs and again where backward
    # recomputes it, wholly or selectively; the tiny model's weights would all stay gathered
    # under DeepSpeed's default threshold) killed and resumed, and ZeRO-2 (gradient buckets
    # filled as gradients get ready): the same losses as the pipeline engine's ZeRO-1, though
    # shares without media or supervised tokens run beside shares with them
    crashed = tmp_path / "crashed"
    logged = lambda: (crashed / "train_log.jsonl").read_text().count("\n") if (  # noqa: E731
        crashed / "train_log.jsonl").exists() else 0
    zero3 = ["--zero", "3", "--zero3-persistence-threshold", "0", "--recompute", "vit_block_0",
             "llm_block_1", "--selective", "llm_block_0"]
    kill_9_when("train", *common, *zero3, "--checkpoint-every", "2", "--out",
                str(crashed), ready=lambda: logged() >= 3, timeout=600, session=True)
    assert 3 <= logged() < steps, "the run ended before its kill"
    capfd.readouterr()
    vlmshard_here("train", *common, *zero3, "--resume", str(crashed))
    said = capfd.readouterr()  # the ranks' output, on this process's descriptors
    assert ("ZeRO-3: 0 weights of 0 elements stay gathered on every rank "
            "(--zero3-persistence-threshold); the other 100.0% of the elements are split"
            ) in said.out + said.err
    resumed = _log(crashed / "train_log.jsonl")
    assert [r["step"] for r in resumed] == list(range(steps))
    assert [r["sp"] for r in resumed] == degrees[:steps]
    assert [r["data"] for r in resumed] == [r["data"] for r in log]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in log], rel=1e-5)
    vlmshard_here("train", *COMMON, "--shards", shards, "--max-steps", "3", "--zero", "2",
                  "--no-save-checkpoints", "--out", str(tmp_path / "zero2"))
    zero2 = _log(tmp_path / "zero2" / "train_log.jsonl")
    assert [r["loss"] for r in zero2] == pytest.approx([r["loss"] for r in log[:3]], rel=1e-5)
    # ZeRO-3's model folder, gathered from every rank's partition, loads with from_pretrained
    # and holds the weights the pipeline engine's ZeRO-1 run ends with
    from transformers import AutoModelForImageTextToText

    three, info = AutoModelForImageTextToText.from_pretrained(crashed / "hf",
                                                             output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    one = AutoModelForImageTextToText.from_pretrained(straight / "hf").state_dict()
    assert three.state_dict().keys() == one.keys()
    # (a key projection's bias has no gradient in exact arithmetic: softmax ignores a shift
    # common to a query's scores; Adam turns its rounding noise into steps of up to --lr, and
    # the two runs' noise differs by 6e-5 after 5 steps; a step missed or misplaced by a rank
    # would be off by --lr, 3e-3)
    for name, tensor in three.state_dict().items():
        torch.testing.assert_close(tensor, one[name], rtol=1e-5, atol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_verify_finds_the_grouped_plan_in_its_shards(grouped):
    """Every planned sample where planned; the micro-batches and samples counted once each, as
    the plan has them, a sequence-parallel step's copies on its group's other ranks apart."""
    import pyarrow.parquet as pq

    _, shards = grouped
    manifest = read_manifest(shards)
    plan = manifest.plan["path"]
    result = vlmshard("verify", shards, "--plan", plan, "--json", check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    verified = json.loads(result.stdout)
    info = json.loads(open(os.path.join(plan, "plan.json")).read())
    sp = [manifest.step_group(t)["sp"] for t in range(manifest.steps)]
    micro = info["params"]["micro_batches"]
    assert verified["samples"] == pq.read_metadata(os.path.join(plan, "plan.parquet")).num_rows
    assert verified["records"] == sum(DP // s * micro for s in sp)
    assert verified["copies"] == sum((DP - DP // s) * micro for s in sp) > 0


def test_shards_with_sequence_parallel_steps_are_refused_where_they_cannot_train(grouped,
                                                                                tmp_path):
    """One line before any rank starts: through the command once, the other cases at the
    check it runs (``sequence_parallel.check_model``)."""
    folder, shards = grouped
    result = vlmshard("train", "--shards", shards, "--pp", "2", "--dp", "4", "--max-steps", "1",
                      "--out", str(tmp_path / "run"), check=False)
    assert result.returncode != 0 and "run at --pp 1" in result.stderr, result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1
    assert not os.path.exists(tmp_path / "run" / "train_log.jsonl")
    model, manifest = model_layers(folder), read_manifest(shards)
    check_model(model, manifest, pp=1, dp=4)  # what the training test runs
    with pytest.raises(ConfigError, match="4 does not divide --dp 2"):
        check_model(model, manifest, pp=1, dp=2)


@pytest.mark.slow(minutes=2)
def test_a_clip_four_times_a_ranks_tiles_is_spread_over_sp_4_and_trains_as_the_hf_model(
        tmp_path):
    """A tiny Qwen2-VL clip of 8 temporal steps of 15 tiles, 4x one rank's --max-qv of 30:
    ``--groups auto`` places it at SP 4; each rank of the group decodes only its own steps'
    frames and gets the pixel rows the whole micro-batch's share has; training it over 4 CPU
    ranks gives the ``transformers`` model's loss. At --max-qv 14 a single step is over a
    rank's tiles: the clip alone is unplaced, with its reason."""
    folder = make_folder("qwen2_vl", str(tmp_path / "model"))
    clip, _, text = clip_rows(tmp_path)  # its image of 54 tiles left out: over a rank's 30
    rows = [clip, text] + [{"conversations": [
        {"from": "human", "value": f"Say {i}"}, {"from": "gpt", "value": f"Number {i}."}]}
        for i in range(6)]
    with open(tmp_path / "rows.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    pre, plan, shards = (str(tmp_path / name) for name in ("pre", "plan", "shards"))
    run_preprocess(PreprocessConfig(inputs=[str(tmp_path / "rows.jsonl")], out=pre,
                                    model=folder, workers=1))
    run_pack(PackConfig(stats=pre, dp=DP, out=plan, groups="auto", max_qt=160, max_qv=30))
    run_write(WriteConfig(plan=plan, stats=pre, out=shards, workers=1))
    manifest = read_manifest(shards)
    info = json.loads(open(os.path.join(plan, "plan.json")).read())
    assert info["unplaced"] == []
    clip_steps, loads = [], {}  # loads: per SP-4 micro-batch, its shares' tiles
    for w in range(DP):
        data = ShardDataset(shards, w, DP, pixel_dtype=torch.float32)
        for record in data.records():
            media = record.media_units()
            sp = manifest.step_group(record.step)["sp"]
            if sp == 4:
                loads.setdefault((record.step, record.micro), []).append(
                    data.collate(record)["num_tiles"])
            if (120, 8) not in media:
                continue
            assert sp == 4
            clip_steps.append(record.step)
            whole = data.collate(record, share=False)
            mine = data.collate(record)
            assert torch.equal(mine["pixel_values"],
                               share(whole, sp, w % sp, 1)["pixel_values"])
            # the rank's own steps' frames decoded, the others' read to their headers
            pieces = media_pieces(media, sp)
            own = {p.medium: (p.first, p.units) for p in pieces if p.owner == w % sp}
            video = next(im for im in decoded_images(record, data.policies, own=own)
                         if im.is_video)
            per_step = len(video.video.indices) // 8
            assert len(video.frames) == per_step * own.get(media.index((120, 8)), (0, 0))[1]
    assert len(clip_steps) == DP and len(set(clip_steps)) == 1
    # the plan's ViT balance of the SP-4 group: its shares' tiles as the ranks load them
    group = next(g for g in info["groups"] if g["sp"] == 4)
    assert group["vit_rank_balance"] == pytest.approx(
        sum(max(t) for t in loads.values()) / sum(sum(t) / 4 for t in loads.values()))
    assert group["vit_rank_balance"] < 120 / (120 / 4)  # the clip whole on one rank: 4
    steps = clip_steps[0] + 1
    out = tmp_path / "run"
    # at learning rate 0 every step starts from the folder's weights
    vlmshard_here("train", "--pp", "1", "--dp", str(DP), "--lr", "0", "--shards", shards,
                  "--max-steps", str(steps), "--no-save-checkpoints", "--out", str(out))
    log = _log(out / "train_log.jsonl")
    model = model_layers(folder)
    total, tokens, _ = hf_loss_and_grads(folder, _whole_steps(shards)[clip_steps[0]],
                                         model.geometry.tokens_per_tile,
                                         model.geometry.pixel_rows_per_tile)
    assert log[-1]["sp"] == 4
    assert log[-1]["loss"] == pytest.approx(total / tokens, rel=1e-5)
    tight = str(tmp_path / "tight")
    run_pack(PackConfig(stats=pre, dp=DP, out=tight, groups="auto", max_qt=160, max_qv=14,
                        max_unplaced_ratio=0.5))
    unplaced = json.loads(open(os.path.join(tight, "plan.json")).read())["unplaced"]
    assert [u["reason"] for u in unplaced] == ["unit_over_rank_qv"]
