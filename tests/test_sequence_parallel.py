"""Sequence parallelism (Ulysses) over packed micro-batches: SP ranks, each with its share of the
tokens and media, give the loss and gradients of one rank with the whole micro-batch, and of the
``transformers`` model on each sample alone; a share is cut as a hand count says."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch
from hf_reference import (
    ROWS,
    clip_rows,
    assert_grad_close,
    grad_floor,
    hf_loss_and_grads,
    make_folder,
    make_shards,
)

from vlmshard.model_sizes import LLMConfig, sequence_parallel_refusal
from vlmshard.preprocess.tokenize import IGNORE_INDEX
from vlmshard.shards.loader import ShardDataset
from vlmshard.shards.model_inputs import next_token_targets
from vlmshard.shards.sequence import Piece, Shard, media_pieces, share
from vlmshard.train.hf_model import model_layers
from vlmshard.train.pipeline import recompute_modes, run_layers
from vlmshard.train.sequence_parallel import Exchange
from vlmshard.train.train_log import micro_batch_size

TESTS = os.path.dirname(os.path.abspath(__file__))


def owners(tiles: list[int], sp: int) -> list[int]:
    """The rank of each image (one unit each) in ``media_pieces``' deal."""
    return [p.owner for p in media_pieces([(t, 1) for t in tiles], sp)]


def test_units_go_largest_first_to_the_least_loaded_rank():
    # by hand, largest first: 9 → r0; 5 → r1; 4 → r1 (load 5 < 9); 3 → r0 (loads 9 and 9:
    # the lower rank)
    assert owners([3, 9, 5, 4], 2) == [0, 0, 1, 1]
    assert owners([], 4) == []
    assert owners([2, 2, 2], 4) == [0, 1, 2]
    # an image of 3, a clip of 4 steps of 3, an image of 5: 5 → r0; 3 → r1; the clip's steps
    # → r1 (5, 6), r0 (8, 6), r1 (8, 9), r0 (11, 9): two steps each, consecutive by rank
    assert media_pieces([(3, 1), (12, 4), (5, 1)], 2) == [
        Piece(0, 0, 1, 3, 1), Piece(1, 0, 2, 6, 0), Piece(1, 2, 2, 6, 1), Piece(2, 0, 1, 5, 0)]
    # a clip alone over 4 ranks: a segment each, the odd step to the lowest ranks
    assert [(p.first, p.units, p.owner) for p in media_pieces([(10, 5)], 4)] == [
        (0, 2, 0), (2, 1, 1), (3, 1, 2), (4, 1, 3)]


@pytest.mark.parametrize("seed", range(4))
def test_each_share_gets_its_image_tokens_features_from_their_owners(seed):
    """The media exchange's plan on random micro-batches (media runs among text, dealt to the
    ranks), run by hand: each rank's features are their image-token indices; what each share
    gets, put in order, must be its own image tokens' indices, counted from the token mask."""
    rng = random.Random(seed)
    for _ in range(50):
        sp = rng.choice([2, 3, 4, 8])
        tokens = [rng.randint(1, 30) for _ in range(rng.randint(0, 7))]
        mask, runs = [], []
        for t in tokens:
            mask += [False] * rng.randint(0, 10)
            runs.append((len(mask), len(mask) + t))
            mask += [True] * t
        mask += [False] * rng.randint(1, 10)
        n, owner = len(mask), owners(tokens, sp)
        length = -(-n // sp)
        firsts = [sum(tokens[:i]) for i in range(len(tokens))]
        shards = [Shard(sp, r, min(r * length, n), length, (n,), tuple(runs), tuple(tokens),
                        tuple(owner)) for r in range(sp)]
        plans = [Exchange(s, None).media_plan() for s in shards]
        features = [torch.tensor([float(firsts[i] + k) for i, o in enumerate(owner) if o == r
                                  for k in range(tokens[i])]) for r in range(sp)]
        sent = [torch.split(features[r][plans[r].send_rows], plans[r].send) for r in range(sp)]
        for me in range(sp):
            got = torch.cat([sent[r][me] for r in range(sp)])
            assert [len(sent[r][me]) for r in range(sp)] == plans[me].receive
            before = sum(mask[:me * length])
            mine = sum(mask[me * length:(me + 1) * length])
            assert got[plans[me].order].tolist() == [float(x) for x in
                                                     range(before, before + mine)]


def test_degrees_the_heads_do_not_split_are_refused_in_one_line():
    assert sequence_parallel_refusal(LLMConfig(heads=4, kv_heads=2), 4) is None  # kv repeated
    assert sequence_parallel_refusal(LLMConfig(heads=12, kv_heads=2), 4) is None
    for heads, kv, sp in [(4, 2, 3), (6, 3, 2), (4, 4, 8), (12, 2, 8)]:
        why = sequence_parallel_refusal(LLMConfig(heads=heads, kv_heads=kv), sp)
        assert "do not split" in why and "\n" not in why
    assert "linear-attention" in sequence_parallel_refusal(
        LLMConfig(heads=4, kv_heads=2, linear_layers=(0,)), 2)


SP_FAMILIES = ["qwen2_vl", "qwen3_vl", "gemma3"]


def _folder_and_shards(family: str, root) -> tuple[str, list[str]]:
    """A model folder and two shards folders of one micro-batch each: every sample with every
    image (the shares split samples and images), and the two-image chat alone (at SP 4, four
    times a share's tokens; two shares without media)."""
    folder = make_folder(family, str(root / "model"))
    mixed = make_shards(folder, root, target_samples=5, micro_batches=1)
    (root / "long").mkdir()
    return folder, [mixed, make_shards(folder, root / "long", rows=ROWS[:1])]


@pytest.fixture(scope="module", params=SP_FAMILIES)
def setup(request, tmp_path_factory):
    return _folder_and_shards(request.param, tmp_path_factory.mktemp(request.param))


def test_a_share_is_its_tokens_and_its_media(setup):
    folder, (shards, _) = setup
    batch = next(iter(ShardDataset(shards, pixel_dtype=torch.float32)))
    n, sp = batch["num_tokens"], 3
    length = -(-n // sp)
    targets = next_token_targets(batch["labels"], batch["cu_seqlens"])[:n]
    shares = [share(batch, sp, r, 1) for r in range(sp)]
    tokens = torch.cat([s["input_ids"] for s in shares])
    assert all(len(s["input_ids"]) == length for s in shares)
    assert torch.equal(tokens[:n], batch["input_ids"][:n])
    assert (tokens[n:] == batch["pad_token_id"]).all()
    labels = torch.cat([s["labels"] for s in shares])
    assert torch.equal(labels[:n], targets) and (labels[n:] == IGNORE_INDEX).all()
    positions = torch.cat([s["position_ids"] for s in shares], dim=-1)
    assert torch.equal(positions[..., :n], batch["position_ids"][..., :n])
    # each medium's pixel rows on exactly one rank, the ranks' tiles within the largest medium
    tiles = batch["media_tiles"].tolist()
    assert sorted(t for s in shares for t in s["media_tiles"].tolist()) == sorted(tiles)
    assert sum(s["num_pixel_rows"] for s in shares) == batch["num_pixel_rows"]
    loads = [s["num_tiles"] for s in shares]
    assert max(loads) - min(loads) <= max(tiles)
    # what each rank logs it trained: the shares' sizes add up to the whole's (a Qwen ViT's
    # attention across each image: each image whole on one rank)
    model = model_layers(folder).sizes()
    sizes = [micro_batch_size(s, model) for s in shares]
    whole = micro_batch_size(batch, model)
    assert sum(x["tokens"] for x in sizes) == whole["tokens"] == n
    assert sum(x["tiles"] for x in sizes) == whole["tiles"]
    assert sum(x.get("vit_squares", 0) for x in sizes) == whole.get("vit_squares", 0)
    assert (whole.get("vit_squares", 0) > 0) == model.vision.fused_qkv
    assert abs(sum(x["squares"] for x in sizes) - whole["squares"]) <= sp
    for s in shares:
        assert s["pixel_values"].shape[0] == s["num_pixel_rows"]


@pytest.mark.parametrize("family", ["internvl", "qwen2_vl", "qwen3_vl", "gemma3"])
def test_a_micro_batch_without_images_trains_as_the_hf_model(family, tmp_path):
    """Text-only micro-batches (as a sequence-parallel rank that encodes no media has): the ViT
    runs on a blank tile whose features go nowhere, every parameter gets its (zero) gradient,
    and loss and gradients are the HF model's."""
    folder = make_folder(family, str(tmp_path / "model"))
    shards = make_shards(folder, tmp_path, rows=[ROWS[2]] * 3, target_samples=2)
    model = model_layers(folder)
    batches = list(ShardDataset(shards, pixel_dtype=torch.float32))
    assert batches and all(b["num_tiles"] == 0 for b in batches)
    layers = model.build_all()
    total = 0.0
    for batch in batches:
        loss = run_layers(layers, model.defs, model.first_micro(batch),
                          recompute_modes(model.names, set(), set(), model)).x
        loss.backward()
        total += float(loss.detach())
    ref_loss, _, ref_grads = hf_loss_and_grads(folder, batches, model.geometry.tokens_per_tile,
                                               model.geometry.pixel_rows_per_tile)
    assert total == pytest.approx(ref_loss, rel=1e-5)
    grads = {layer.hf_name(local): p.grad for layer in layers
             for local, p in layer.named_parameters()}
    assert all(g is not None for g in grads.values())
    floor = grad_floor(ref_grads)
    for name, grad in ref_grads.items():
        assert_grad_close(name, grads[name], grad, floor)


def _launch(jobs: dict[str, list[str]], degrees: list[int], out: str) -> dict:
    """Each folder's results (``sequence_parallel_worker.py``), from one launch for them all."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": TESTS}
    args = [a for folder, shards in jobs.items() for a in (folder, ",".join(shards))]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={max(degrees)}", os.path.join(TESTS, "sequence_parallel_worker.py"),
         out, ",".join(map(str, degrees)), *args],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "FutureWarning" not in proc.stderr, proc.stderr[-6000:]  # no deprecated exchange
    return torch.load(out)


CLIP_FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "internvl"]
# 8 query heads for SP 8: a wider LLM where heads are hidden / heads (Qwen2.5-VL), and
# InternVL3.5's Qwen3 LLM (heads of 16 apart)
WIDE = {"qwen2_5_vl": {"text_sizes": {"hidden_size": 64, "num_attention_heads": 8},
                       "vision_sizes": {"out_hidden_size": 64}},
        "qwen3_vl": {"text_sizes": {"num_attention_heads": 8}},
        "internvl": {"llm": "qwen3", "text_sizes": {"num_attention_heads": 8}}}


def _clip_jobs(families, root, wide: bool = False) -> dict[str, tuple[str, list[str]]]:
    """Per family, a folder and its shards folders: ``_folder_and_shards``'s and, for a family
    with video, a micro-batch of a long clip, an image row and a text-only row."""
    jobs = {}
    for family in families:
        (root / family).mkdir(parents=True)
        if wide:
            folder = make_folder(family, str(root / family / "model"), **WIDE[family])
            shards = [make_shards(folder, root / family, target_samples=5, micro_batches=1)]
        else:
            folder, shards = _folder_and_shards(family, root / family)
        if family in CLIP_FAMILIES:
            (root / family / "clip").mkdir()
            shards.append(make_shards(folder, root / family / "clip",
                                      rows=clip_rows(root / family / "clip"),
                                      target_samples=3, micro_batches=1))
        jobs[family] = (folder, shards)
    return jobs


def _assert_equal_to_hf(jobs: dict, got: dict, degrees: list[int]) -> None:
    for family, (folder, shards) in jobs.items():
        model = model_layers(folder)
        batches = [b for path in shards for b in ShardDataset(path, pixel_dtype=torch.float32)]
        assert all(b["num_tiles"] > 0 for b in batches), family
        if family in CLIP_FAMILIES:  # the clip's steps spread over the group's ranks
            clip = batches[-1]
            assert clip["num_samples"] == 3 and clip["media_is_video"].tolist() == [True, False]
            media = list(zip(clip["media_tiles"].tolist(), clip["media_units"].tolist()))
            for sp in degrees:
                owners = {p.owner for p in media_pieces(media, sp) if p.medium == 0}
                assert len(owners) >= min(media[0][1], sp - 1), (family, sp)
        ref_loss, _, ref_grads = hf_loss_and_grads(folder, batches,
                                                   model.geometry.tokens_per_tile,
                                                   model.geometry.pixel_rows_per_tile)
        floor = grad_floor(ref_grads)
        for sp in degrees:
            result = got[folder][sp]
            assert result["loss"] == pytest.approx(ref_loss, rel=1e-5), (family, sp)
            assert set(result["grads"]) == set(ref_grads), (family, sp)
            for name, grad in ref_grads.items():
                assert_grad_close(f"{family} SP {sp} {name}", result["grads"][name], grad,
                                  floor)


@pytest.mark.slow(minutes=4)
def test_sequence_parallel_loss_and_gradients_equal_one_rank_and_the_hf_model(tmp_path):
    """For each family: SP 2 (two groups, a micro-batch each) and SP 4 over 4 processes (Qwen's
    and Gemma's 2 key/value heads repeated to 4; Gemma 3's sliding windows and images attended
    both ways; a long clip's temporal steps spread over the group, Qwen2.5-VL's windows and
    Qwen3-VL's DeepStack and timestamps with them), and SP 8 over 8 processes on the video
    families with 8 query heads: the summed loss and every gradient, against the
    ``transformers`` model on each sample alone (which one rank with the whole micro-batch
    equals: ``test_model.py``)."""
    jobs = _clip_jobs(["gemma3", *CLIP_FAMILIES], tmp_path / "narrow")
    wide = _clip_jobs(list(WIDE), tmp_path / "wide", wide=True)
    _assert_equal_to_hf(jobs, _launch(dict(jobs.values()), [2, 4], str(tmp_path / "sp.pt")),
                        [2, 4])
    _assert_equal_to_hf(wide, _launch(dict(wide.values()), [8], str(tmp_path / "sp8.pt")), [8])
