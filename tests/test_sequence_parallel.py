"""Sequence parallelism (Ulysses) over packed micro-batches: SP ranks, each with its share of the
tokens and media, give the loss and gradients of one rank with the whole micro-batch, and of the
``transformers`` model on each sample alone; a share is cut as a hand count says."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hf_reference import (
    ROWS,
    assert_grad_close,
    grad_floor,
    hf_loss_and_grads,
    make_folder,
    make_shards,
)

from vlmshard.errors import ConfigError
from vlmshard.preprocess.tokenize import IGNORE_INDEX
from vlmshard.shards.loader import ShardDataset
from vlmshard.shards.model_inputs import next_token_targets
from vlmshard.shards.sequence import media_owners, share
from vlmshard.train.hf_model import model_layers
from vlmshard.train.pipeline import recompute_modes, run_layers
from vlmshard.train.sequence_parallel import check_heads
from vlmshard.train.train_log import micro_batch_size

TESTS = os.path.dirname(os.path.abspath(__file__))
MICRO_BATCHES = 2


def test_media_go_largest_first_to_the_least_loaded_rank():
    # by hand: 9 → r0; 5 → r1; 4 → r1 (5 < 9); 3 → r1 (9 = 9, lower rank... r0 9, r1 9: r0)
    assert media_owners([3, 9, 5, 4], 2) == [0, 0, 1, 1]
    assert media_owners([], 4) == []
    assert media_owners([2, 2, 2], 4) == [0, 1, 2]


def test_bad_degrees_are_refused_in_one_line():
    check_heads(4, 2, 4, "tiny")  # kv heads repeated to 4
    for heads, kv, sp in [(4, 2, 3), (6, 3, 2), (4, 4, 8)]:
        with pytest.raises(ConfigError, match="do not split") as e:
            check_heads(heads, kv, sp, "tiny")
        assert "\n" not in str(e.value)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl"])
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    folder = make_folder(request.param, str(root / "model"))
    # every sample in one micro-batch with every image: the shares split samples and images
    shards = make_shards(folder, root, target_samples=5, micro_batches=1)
    return folder, shards


def test_a_share_is_its_tokens_and_its_media(setup):
    folder, shards = setup
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
    # what each rank logs it trained: the shares' sizes add up to the whole's
    sizes, whole = [micro_batch_size(s) for s in shares], micro_batch_size(batch)
    assert sum(x["tokens"] for x in sizes) == whole["tokens"] == n
    assert sum(x["tiles"] for x in sizes) == whole["tiles"]
    assert abs(sum(x["squares"] for x in sizes) - whole["squares"]) <= sp
    for s in shares:
        assert s["pixel_values"].shape[0] == s["num_pixel_rows"]
        assert s["shard"].image_token_start == int(batch["image_token_mask"][:s["shard"].start].sum())


def test_a_micro_batch_without_images_trains_as_the_hf_model(setup, tmp_path):
    """Text-only micro-batches (as a sequence-parallel rank that encodes no media has): the ViT
    layers take no patches, and loss and gradients are the HF model's."""
    folder, _ = setup
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
    floor = grad_floor(ref_grads)
    for name, grad in ref_grads.items():
        assert_grad_close(name, grads[name], grad, floor)


def _launch(folder: str, shards: str, sp: int, out: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": TESTS}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={sp}",
         os.path.join(TESTS, "sequence_parallel_worker.py"), folder, shards, str(MICRO_BATCHES),
         out], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(out)


@pytest.mark.slow(minutes=1.5)
def test_sequence_parallel_loss_and_gradients_equal_one_rank_and_the_hf_model(setup, tmp_path):
    """SP 2 and 4 (Qwen's 2 key/value heads repeated to 4) on the same micro-batches: the
    summed loss and every gradient, against the ``transformers`` model on each sample alone
    (which one rank with the whole micro-batch equals: ``test_model.py``)."""
    folder, shards = setup
    model = model_layers(folder)
    batches = list(ShardDataset(shards, pixel_dtype=torch.float32))[:MICRO_BATCHES]
    assert sum(b["num_tiles"] > 0 for b in batches) >= 1
    ref_loss, _, ref_grads = hf_loss_and_grads(folder, batches, model.geometry.tokens_per_tile,
                                               model.geometry.pixel_rows_per_tile)
    floor = grad_floor(ref_grads)
    for sp in (2, 4):
        got = _launch(folder, shards, sp, str(tmp_path / f"sp{sp}.pt"))
        assert got["loss"] == pytest.approx(ref_loss, rel=1e-5), sp
        assert set(got["grads"]) == set(ref_grads)
        for name, grad in ref_grads.items():
            assert_grad_close(name, got["grads"][name], grad, floor)
