"""The VLM's packed path, and the pipeline layers DeepSpeed runs, equal each sample alone (loss
and gradients); the analytic per-layer costs equal what the real layers hold and compute."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from vlmshard.train import model as M
from vlmshard.model_sizes import Size, layer_work
from vlmshard.model_sizes import PRESETS, LLMConfig, ModelConfig, VisionConfig
from vlmshard.train.model import VLM, next_token_targets, pixel_shuffle, segments
from vlmshard.train.pipeline import AveTokenLoss, Carry, Head, pipeline_inputs
from vlmshard.train.trainer import supervised_tokens

CONFIG = ModelConfig(vision=VisionConfig(image_size=56, hidden=16, layers=2, heads=2),
                     llm=LLMConfig(vocab_size=500, hidden=32, layers=2, heads=4, kv_heads=2,
                                   intermediate=64))
IMAGE_TOKEN = 7


def _sample(gen: torch.Generator, length: int, tiles: int) -> dict:
    """Token ids with ``tiles`` image-token blocks after a BOS, labels on the second half."""
    per_tile = CONFIG.tokens_per_tile
    ids = torch.randint(10, CONFIG.llm.vocab_size, (length,), generator=gen)
    ids[1:1 + tiles * per_tile] = IMAGE_TOKEN
    labels = torch.full((length,), -100)
    labels[length // 2:] = ids[length // 2:]
    pixels = torch.randn(tiles, 3, 56, 56, generator=gen)
    return {"ids": ids, "labels": labels, "pixels": pixels}


def _batch(samples: list[dict], qt: int, qv: int) -> dict:
    """Pack samples as the shard loader collates them (padding is a segment of its own)."""
    ids = torch.cat([s["ids"] for s in samples])
    labels = torch.cat([s["labels"] for s in samples])
    n, pad = len(ids), qt - len(ids)
    lens = [len(s["ids"]) for s in samples] + ([pad] if pad else [])
    pixels = torch.zeros(qv, 3, 56, 56)
    tiles = torch.cat([s["pixels"] for s in samples])
    pixels[:len(tiles)] = tiles
    input_ids = torch.cat([ids, torch.zeros(pad, dtype=ids.dtype)])
    return {"input_ids": input_ids,
            "labels": torch.cat([labels, torch.full((pad,), -100)]),
            "position_ids": torch.cat([torch.arange(x) for x in lens]),
            "image_token_mask": torch.cat([ids == IMAGE_TOKEN, torch.zeros(pad, dtype=bool)]),
            "pixel_values": pixels, "num_tiles": len(tiles), "num_tokens": n}


def _loss_and_grads(model: VLM, batches: list[dict]) -> tuple[float, dict]:
    model.zero_grad()
    total = sum(model(b) for b in batches)
    total.backward()
    return float(total.detach()), {k: p.grad.clone() for k, p in model.named_parameters()
                          if p.grad is not None}


def test_packed_equals_one_by_one():
    torch.manual_seed(0)
    model = VLM(CONFIG)
    gen = torch.Generator().manual_seed(1)
    samples = [_sample(gen, 40, 2), _sample(gen, 25, 0), _sample(gen, 33, 1)]
    packed_loss, packed = _loss_and_grads(model, [_batch(samples, qt=110, qv=4)])
    alone_loss, alone = _loss_and_grads(
        model, [_batch([s], qt=len(s["ids"]), qv=len(s["pixels"])) for s in samples])
    assert abs(packed_loss - alone_loss) <= 1e-5 * abs(alone_loss)
    assert packed.keys() == alone.keys()
    for name in packed:
        torch.testing.assert_close(packed[name], alone[name], rtol=1e-5, atol=1e-6, msg=name)


def test_pipeline_layers_with_recompute_and_ave_token_equal_the_reference():
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
    gen = torch.Generator().manual_seed(1)
    samples = [_sample(gen, 40, 2), _sample(gen, 25, 0), _sample(gen, 33, 1)]
    step = [_batch(samples[:2], qt=80, qv=3), _batch(samples[2:], qt=40, qv=2)]
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
    alone_loss, alone = _loss_and_grads(
        reference, [_batch([s], qt=len(s["ids"]), qv=len(s["pixels"])) for s in samples])
    assert total == pytest.approx(alone_loss / loss.global_tokens, rel=1e-5)
    pipeline_grads = {f"layers.{i}.{name}": p.grad
                      for i, carry in enumerate(layers[:-1])
                      for name, p in carry.inner.named_parameters() if p.grad is not None}
    pipeline_grads.update((name, p.grad) for name, p in layers[-1].named_parameters()
                          if p.grad is not None)
    assert pipeline_grads.keys() == alone.keys()
    for name, grad in pipeline_grads.items():  # Ave-Token: the per-token mean's gradient
        torch.testing.assert_close(grad * loss.global_tokens, alone[name], rtol=1e-5, atol=1e-6,
                                   msg=name)


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
    assert config.tokens_per_tile == 256  # what the demo shards are tokenized with


def test_real_presets_have_their_published_sizes():
    total = {name: sum(w.params for w in layer_work(PRESETS[name])) / 1e9
             for name in ("internvl2-2b", "internvl-chat-1.5")}
    assert 2.1 < total["internvl2-2b"] < 2.3  # InternVL2-2B: 2.2B
    assert 25.0 < total["internvl-chat-1.5"] < 26.0  # InternVL-Chat-V1.5: 25.5B


def test_analytic_params_and_flops_equal_the_real_layers():
    """Parameters exactly; matmul/conv FLOPs exactly; causal attention is half the FLOPs of the
    full score matrix that PyTorch's math path computes."""
    gen = torch.Generator().manual_seed(0)
    samples = [_sample(gen, 300, 2), _sample(gen, 70, 1), _sample(gen, 30, 0)]
    batch = _batch(samples, qt=420, qv=4)
    lens = [len(s["ids"]) for s in samples]  # the padding after them attends to nothing
    size = Size(tiles=batch["num_tiles"], tokens=420, squares=sum(n * n for n in lens))
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
