"""The VLM's packed path, and the pipeline layers DeepSpeed runs, equal each sample alone (loss
and gradients); the analytic per-layer costs equal what the real layers hold and compute. Every
micro-batch comes from real shards through the real loader (shards.loader), packed or alone."""

from __future__ import annotations

import json
import os

import pytest
import torch
from PIL import Image
from torch.utils.flop_counter import FlopCounterMode

from vlmshard.train import model as M
from vlmshard.model_sizes import Size, layer_work
from vlmshard.model_sizes import PRESETS, LLMConfig, ModelConfig, VisionConfig
from vlmshard.train.model import VLM, next_token_targets, pixel_shuffle, segments
from vlmshard.train.pipeline import AveTokenLoss, Carry, Head, pipeline_inputs
from vlmshard.train.trainer import supervised_tokens
from vlmshard.packing.config import PackConfig
from vlmshard.packing.plan import run_pack
from vlmshard.preprocess import PreprocessConfig, run_preprocess
from vlmshard.shards.loader import make_loader
from vlmshard.shards.config import WriteConfig
from vlmshard.shards.writer import run_write

# Small widths, but the shapes the shards fix: 448 px tiles of 14 px patches, pixel-shuffled to
# 256 image tokens, and every Tekken token id.
CONFIG = ModelConfig(vision=VisionConfig(image_size=448, hidden=16, layers=2, heads=2),
                     llm=LLMConfig(vocab_size=131072, hidden=32, layers=2, heads=4, kv_heads=2,
                                   intermediate=64))


@pytest.fixture(scope="module")
def shards(demo, tmp_path_factory) -> dict[str, str]:
    """Short conversations with no image, a 1-tile image or a 3-tile one (2×1 grid + thumbnail),
    through the real stages: preprocessed, then packed and written twice, ``packed`` (several
    samples per micro-batch, 2 micro-batches a step) and ``alone`` (one sample per micro-batch)."""
    root = tmp_path_factory.mktemp("model")
    photos = [p for p in demo.images if p.endswith((".jpg", ".png"))][:2]
    for i, (photo, size) in enumerate(zip(photos, [(448, 448), (896, 448)])):
        with Image.open(os.path.join(demo.root, photo)) as im:
            im.convert("RGB").resize(size).save(root / f"photo{i}.jpg")
    with open(root / "talk.jsonl", "w") as f:
        for i in range(12):
            row = {"conversations": [
                {"from": "human", "value": f"Describe item {i}" + " please" * (i % 5) + "."},
                {"from": "gpt", "value": "It is an item" + " of note" * (3 * i % 7) + "."}]}
            if i % 3:  # a third without an image
                row["image"] = f"photo{i % 3 - 1}.jpg"
                row["conversations"][0]["value"] = "<image>\n" + row["conversations"][0]["value"]
            f.write(json.dumps(row) + "\n")
    run_preprocess(PreprocessConfig(inputs=[str(root / "talk.jsonl")], out=str(root / "pre"),
                                    keep_tokens=True, workers=1))
    out = {}
    for name, options in [("packed", dict(algo="balanced", target_samples=3, micro_batches=2)),
                          ("alone", dict(algo="random", target_samples=1))]:
        run_pack(PackConfig(stats=str(root / "pre"), dp=1, out=str(root / f"plan-{name}"),
                            **options))
        run_write(WriteConfig(plan=str(root / f"plan-{name}"), stats=str(root / "pre"),
                              out=str(root / name), workers=1))
        out[name] = str(root / name)
    return out


def _loader(root: str) -> list[dict]:
    """Every micro-batch of the shards as the trainer gets them: the real loader's collate."""
    return list(make_loader(root))


def _packed_and_alone(shards) -> tuple[list[dict], list[list[dict]]]:
    """The first step of the packed shards (2 micro-batches), and each micro-batch's samples
    alone, as the loader gives them from the one-sample-per-micro-batch shards."""
    packed = _loader(shards["packed"])[:2]
    alone = {int(b["sample_ids"][0]): b for b in _loader(shards["alone"])}
    assert all(b["num_samples"] == 1 for b in alone.values())
    return packed, [[alone[int(i)] for i in b["sample_ids"]] for b in packed]


def _atol(grad: torch.Tensor) -> float:
    """fp32 rounding of sums over a real micro-batch (1024 patches a tile, hundreds of tokens):
    an entry that cancels to near zero keeps an error of about 1e-5 of the tensor's largest."""
    return 1e-5 * float(grad.abs().max())


def _loss_and_grads(model: VLM, batches: list[dict]) -> tuple[float, dict]:
    model.zero_grad()
    total = sum(model(b) for b in batches)
    total.backward()
    return float(total.detach()), {k: p.grad.clone() for k, p in model.named_parameters()
                          if p.grad is not None}


def test_packed_equals_one_by_one(shards):
    torch.manual_seed(0)
    model = VLM(CONFIG)
    packed, alone = _packed_and_alone(shards)
    i = max(range(len(packed)), key=lambda i: packed[i]["num_samples"])
    batch, singles = packed[i], alone[i]
    assert batch["num_samples"] >= 2 and batch["num_tiles"] >= 1
    packed_loss, packed_grads = _loss_and_grads(model, [batch])
    alone_loss, alone_grads = _loss_and_grads(model, singles)
    assert abs(packed_loss - alone_loss) <= 1e-5 * abs(alone_loss)
    assert packed_grads.keys() == alone_grads.keys()
    for name in packed_grads:
        torch.testing.assert_close(packed_grads[name], alone_grads[name], rtol=1e-5,
                                   atol=_atol(alone_grads[name]),
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_pipeline_layers_with_recompute_and_ave_token_equal_the_reference(shards):
    """What DeepSpeed runs (Carry layers, some recomputed, the Head, AveTokenLoss over a step of
    two micro-batches) against the reference model on each sample alone, per token."""
    torch.manual_seed(0)
    reference = VLM(CONFIG)
    recomputed = {1, 3, 5}
    layers = [Carry(cls, CONFIG, recompute=i in recomputed)
              for i, (cls, _) in enumerate(M.layer_specs(CONFIG))] + [Head(CONFIG)]
    for carry, layer in zip(layers, reference.layers):
        carry.inner.load_state_dict(layer.state_dict())
    layers[-1].norm.load_state_dict(reference.norm.state_dict())
    layers[-1].loss.load_state_dict(reference.loss.state_dict())
    step, alone = _packed_and_alone(shards)
    singles = [b for batches in alone for b in batches]
    loss = AveTokenLoss()
    loss.global_tokens = sum(supervised_tokens(b) for b in step)

    total = 0.0
    for batch in step:  # the pipeline's micro-steps: forward through every layer, loss, backward
        x, labels = pipeline_inputs(batch)
        for layer in layers:
            x = layer(x)
        micro = loss(x, labels)
        micro.backward()
        total += float(micro.detach())
    alone_loss, alone = _loss_and_grads(reference, singles)
    assert total == pytest.approx(alone_loss / loss.global_tokens, rel=1e-5)
    pipeline_grads = {f"layers.{i}.{name}": p.grad
                      for i, carry in enumerate(layers[:-1])
                      for name, p in carry.inner.named_parameters() if p.grad is not None}
    pipeline_grads.update((name, p.grad) for name, p in layers[-1].named_parameters()
                          if p.grad is not None)
    assert pipeline_grads.keys() == alone.keys()
    for name, grad in pipeline_grads.items():  # Ave-Token: the per-token mean's gradient
        torch.testing.assert_close(grad * loss.global_tokens, alone[name], rtol=1e-5,
                                   atol=_atol(alone[name]),
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_targets_never_cross_samples():
    labels = torch.tensor([-100, 5, 6, -100, 8, 9, -100, -100])
    position_ids = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    assert next_token_targets(labels, position_ids).tolist() == [5, 6, -100, 8, 9, -100, -100,
                                                                 -100]
    assert segments(position_ids) == [(0, 3), (3, 6), (6, 8)]


def test_pixel_shuffle_groups_2x2_neighbours():
    x = torch.arange(16.0).view(1, 16, 1)  # a 4x4 grid of patches, one channel
    out = pixel_shuffle(x, 0.5)
    assert out.shape == (1, 4, 4)
    # Each output token holds one 2x2 block of neighbouring patches.
    assert sorted(out[0, 0].tolist()) == [0.0, 1.0, 4.0, 5.0]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_valid_and_named_like_the_pipeline(name):
    config = ModelConfig.from_dict(name)
    assert config == PRESETS[name]
    assert [w.name for w in layer_work(config)] == config.layer_names()
    # what the shards of its family are tokenized with: a 448-px InternVL tile makes 256 tokens,
    # a 28-px Qwen2-VL merged patch one
    assert config.tokens_per_tile == (1 if name == "qwen2-vl-2b" else 256)


def test_real_presets_have_their_published_sizes():
    total = {name: sum(w.params for w in layer_work(PRESETS[name])) / 1e9
             for name in ("internvl2-2b", "internvl-chat-1.5")}
    assert 2.1 < total["internvl2-2b"] < 2.3  # InternVL2-2B: 2.2B
    assert 25.0 < total["internvl-chat-1.5"] < 26.0  # InternVL-Chat-V1.5: 25.5B


def test_analytic_params_and_flops_equal_the_real_layers(shards):
    """Parameters exactly; matmul/conv FLOPs exactly; causal attention is half the FLOPs of the
    full score matrix that PyTorch's math path computes."""
    batch = max(_loader(shards["packed"]), key=lambda b: (b["num_tiles"], b["num_samples"]))
    assert batch["num_tiles"] >= 3 and batch["num_samples"] >= 2
    cu = batch["cu_seqlens"][:batch["num_samples"] + 1].tolist()
    lens = [b - a for a, b in zip(cu, cu[1:])]  # the padding after them attends to nothing
    qt = batch["input_ids"].shape[0]
    size = Size(tiles=batch["num_tiles"], tokens=qt, squares=sum(n * n for n in lens))
    v, t = CONFIG.vision, CONFIG.llm
    patches = (v.image_size // v.patch_size) ** 2
    x = (batch["pixel_values"], batch["input_ids"], batch["position_ids"],
         batch["image_token_mask"], torch.tensor(batch["num_tiles"]),
         torch.tensor(batch["num_tokens"]))
    layers = [cls(CONFIG) for cls, _ in M.layer_specs(CONFIG)]
    work = layer_work(CONFIG)
    for layer, w in zip(layers, work):
        assert w.params == sum(p.numel() for p in layer.parameters()), w.name
        with FlopCounterMode(display=False) as counter:
            x = layer(x)
        counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
        matmul = sum(n for op, n in counts.items() if op != "aten.bmm")
        if w.name.startswith("vit_block"):
            attention = 4 * patches ** 2 * v.hidden * size.tiles
        elif w.name.startswith("llm_block"):
            attention = 2 * t.hidden * size.squares
            assert counts["aten.bmm"] == 2 * attention
        else:
            attention = 0
        assert matmul == w.flops.dot(size) - attention, w.name
    head = [M.FinalNorm(CONFIG), M.PackedLMLoss(CONFIG)]
    assert work[-1].params == sum(p.numel() for m in head for p in m.parameters())
