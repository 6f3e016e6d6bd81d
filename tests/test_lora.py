"""LoRA on the LLM through PEFT (``--lora-rank``): the reference is the ``transformers`` model
wrapped by PEFT itself (``peft.get_peft_model`` with the same ``LoraConfig``, or
``peft.PeftModel.from_pretrained`` on the run's adapter folder)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import kill_9_when, vlmshard_here
from hf_reference import (
    FAMILIES,
    ROWS,
    assert_grad_close,
    grad_floor,
    hf_loss_and_grads,
    make_folder,
    make_shards,
    pipeline_grads,
)

from vlmshard.errors import ConfigError
from vlmshard.recipe import LORA_TARGETS, Lora, Recipe
from vlmshard.shards.loader import ShardDataset
from vlmshard.train.config import TrainConfig
from vlmshard.train.hf_model import model_layers

RANK = 4


def _losses(run) -> list[float]:
    with open(run / "train_log.jsonl") as f:
        return [json.loads(line)["loss"] for line in f]


def _peft(adapter: str, before: bool = False):
    """``prepare`` for ``hf_loss_and_grads``: the model as PEFT adds the adapter folder
    ``adapter`` to it; with ``before``, as before the run's first step: PEFT's own fresh
    adapters (B zero) with the folder's A matrices (A has no gradient while B is zero, so the
    first step leaves it as it was), and the modules it trains in full as the model has them."""
    def prepare(model):
        from peft import PeftConfig, PeftModel, get_peft_model
        from safetensors.torch import load_file

        if not before:
            return PeftModel.from_pretrained(model, adapter)
        peft = get_peft_model(model, PeftConfig.from_pretrained(adapter))
        saved = load_file(f"{adapter}/adapter_model.safetensors")
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if ".lora_A." in name:
                    p.copy_(saved[name.replace(".default.", ".")])
        return peft
    return prepare


def _step_loss(folder: str, batches: list[dict], model, adapter: str) -> float:
    loss, count, _ = hf_loss_and_grads(folder, batches, model.geometry.tokens_per_tile,
                                       model.geometry.pixel_rows_per_tile,
                                       prepare=_peft(adapter))
    return loss / count


@pytest.mark.slow(minutes=1.5)
@pytest.mark.parametrize("family, parts, bounds", [("qwen2_vl", "llm", "0,5,8"),
                                                   ("qwen3_vl", "llm", "0,7,11"),
                                                   ("internvl", "projector,llm", "0,2,8")])
def test_lora_trains_as_peft_on_the_hf_model(family, parts, bounds, tmp_path):
    """PP=2: step 0's loss and the gradient of every adapter (and, for InternVL's recipe, of
    the projector trained in full) equal the PEFT-wrapped ``transformers`` model's with the
    same adapters; each later step's loss equals PEFT's with the adapter folder that step's
    checkpoint wrote; the merged folder's logits equal PEFT's with the final adapter, and every
    weight no adapter touches is bit-identical to the folder's. Qwen2-VL's and Qwen3-VL's cut
    falls after the first adapted block (the gradient crosses back to it; Qwen3-VL's DeepStack
    features cross forward), InternVL's after the frozen ViT."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    folder = make_folder(family, str(tmp_path / "model"))
    shards = make_shards(folder, tmp_path, rows=ROWS, micro_batches=2, target_samples=3)
    run = tmp_path / "run"
    vlmshard_here("train", "--shards", shards, "--pp", "2", "--max-steps", "3", "--lr", "0.01",
                  "--warmup-steps", "0", "--max-grad-norm", "0", "--checkpoint-every", "1",
                  "--train", parts, "--lora-rank", str(RANK), "--merge",
                  "--bounds", *bounds.split(","), "--out", str(run))
    model = model_layers(folder)
    batches = list(ShardDataset(shards, pixel_dtype=torch.float32))[:2]  # every step's
    projector = {"internvl": "multi_modal_projector"}.get(family)
    loss, count, ref_grads = hf_loss_and_grads(
        folder, batches, model.geometry.tokens_per_tile, model.geometry.pixel_rows_per_tile,
        prepare=_peft(str(run / "checkpoints" / "step-1" / "adapter"), before=True))
    losses = _losses(run)
    assert losses[0] == pytest.approx(loss / count, rel=1e-5)
    grads = {k: v for g in pipeline_grads(run, model).values() for k, v in g.items()}
    ref = {k.removeprefix("base_model.model.").replace("modules_to_save.default.", ""): v
           for k, v in ref_grads.items()}
    assert set(grads) == set(ref)
    assert any(".lora_A." in n for n in ref) and any(".lora_B." in n for n in ref)
    assert all(".lora_" in n or (projector and projector in n) for n in ref)
    floor = grad_floor(ref)
    for name, grad in ref.items():
        assert_grad_close(name, grads[name] * count, grad, floor)
    for step in (1, 2):
        assert losses[step] == pytest.approx(_step_loss(
            folder, batches, model, str(run / "checkpoints" / f"step-{step}" / "adapter")),
            rel=1e-5), step

    base = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    original = {n: p.detach().clone() for n, p in base.named_parameters()}
    peft = PeftModel.from_pretrained(base, str(run / "adapter"))
    merged = AutoModelForImageTextToText.from_pretrained(str(run / "hf"), dtype=torch.float32)
    ids = batches[0]["input_ids"][:48][None]
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, peft(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)
    adapted = {n.split(".lora_")[0].removeprefix("base_model.model.") + ".weight"
               for n, _ in peft.named_parameters() if ".lora_A." in n}
    for name, tensor in merged.named_parameters():
        touched = name in adapted or (projector is not None and projector in name)
        assert torch.equal(tensor, original[name]) != touched, name


@pytest.mark.slow(minutes=2.5)
def test_lora_under_zero_2_and_3_and_after_kill_9_trains_as_the_pipeline(tmp_path):
    """At PP=1 under ZeRO-2, and under ZeRO-3 killed with -9 after its first checkpoint and
    resumed: the pipeline's (PP=2) losses, and adapters that load with PEFT to its logits."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    folder = make_folder("qwen2_vl", str(tmp_path / "model"))
    shards = make_shards(folder, tmp_path, rows=ROWS, micro_batches=2, target_samples=3)
    common = ["--shards", shards, "--max-steps", "4", "--lr", "0.01", "--warmup-steps", "0",
              "--train", "llm", "--lora-rank", str(RANK)]
    vlmshard_here("train", *common, "--pp", "2", "--out", str(tmp_path / "pipeline"))
    vlmshard_here("train", *common, "--zero", "2", "--out", str(tmp_path / "zero2"))
    crashed = tmp_path / "zero3"
    zero3 = [*common, "--zero", "3", "--zero3-persistence-threshold", "0",
             "--checkpoint-every", "2"]
    logged = lambda: (crashed / "train_log.jsonl").read_text().count("\n") if (  # noqa: E731
        crashed / "train_log.jsonl").exists() else 0
    kill_9_when("train", *zero3, "--out", str(crashed), ready=lambda: logged() >= 3,
                timeout=600, session=True)
    assert 3 <= logged() < 4, "the run ended before its kill"
    vlmshard_here("train", *zero3, "--resume", str(crashed))
    reference = _losses(tmp_path / "pipeline")
    for name in ("zero2", "zero3"):
        assert _losses(tmp_path / name) == pytest.approx(reference, rel=1e-5), name
    ids = list(ShardDataset(shards, pixel_dtype=torch.float32))[0]["input_ids"][:48][None]
    logits = {}
    for name in ("pipeline", "zero2", "zero3"):
        base = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
        with torch.no_grad():
            logits[name] = PeftModel.from_pretrained(base, str(tmp_path / name / "adapter"))(
                input_ids=ids).logits
    for name in ("zero2", "zero3"):
        torch.testing.assert_close(logits[name], logits["pipeline"], rtol=1e-4, atol=1e-4)


def test_a_lora_blocks_flops_are_what_autograd_runs(tmp_path):
    """A Qwen2-VL decoder block with PEFT's adapters, counted by torch's FlopCounterMode through
    forward and backward: its frozen weights' matmuls twice (forward, input gradient), the
    adapters' three times; the analytic count (``layer_training_flops`` in mode ``lora``)."""
    from torch.utils.flop_counter import FlopCounterMode

    from vlmshard.model_sizes import layer_training_flops, with_adapters

    folder = make_folder("qwen2_vl", str(tmp_path / "model"))
    lora = Lora(RANK, 2.0 * RANK)
    layers = model_layers(folder, recipe=Recipe(("llm",), lora=lora))
    index = layers.names.index("llm_block_0")
    block = layers.build_layer(index).layer
    rotary = layers.meta.model.language_model.rotary_emb
    tokens = 23
    hidden = torch.randn(1, tokens, layers.config.get_text_config().hidden_size,
                         requires_grad=True)
    positions = torch.arange(tokens).expand(3, 1, tokens)
    with torch.no_grad():
        rope = type(rotary)(rotary.config)(hidden, positions)
    with FlopCounterMode(display=False) as counter:
        out = block(hidden, attention_mask=None, position_embeddings=rope, use_cache=False)
        (out[0] if isinstance(out, tuple) else out).sum().backward()
    matmuls = sum(n for op, n in counter.get_flop_counts()["Global"].items()
                  if op.__name__.split(".")[0] in ("mm", "addmm", "bmm"))
    work = with_adapters(layers.analytic_work(), layers.sizes(), None)[index]
    adapters = layers.analytic_work()[index]
    assert adapters.adapter_params == sum(p.numel() for n, p in block.named_parameters()
                                          if ".lora_" in n)
    assert matmuls == layer_training_flops(adapters, "lora").tokens * tokens
    assert matmuls == (2 * work.flops.tokens + 3 * adapters.adapter_flops.tokens) * tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_the_analytic_adapters_are_the_ones_peft_adds(family, tmp_path):
    """For every family, each decoder block's adapter parameters in the analytic model equal
    what PEFT adds to the real block (attention's projections, a dense MLP's, a shared
    expert's; never a linear-attention mixer's or routed experts')."""
    from vlmshard.train.lora import add_adapters

    folder = make_folder(family, str(tmp_path / "model"))
    lora = Lora(RANK, 2.0 * RANK)
    layers = model_layers(folder, recipe=Recipe(("llm",), lora=lora))
    work = layers.analytic_work()
    blocks = [i for i, n in enumerate(layers.names) if n.startswith("llm_block_")]
    assert any(work[i].adapter_params for i in blocks)
    for i in blocks:
        block = layers.defs[i].build(layers.meta).layer
        add_adapters(block, lora, i)
        assert work[i].adapter_params == sum(p.numel() for n, p in block.named_parameters()
                                             if ".lora_" in n), layers.names[i]


def test_lora_options_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="--merge folds LoRA adapters"):
        TrainConfig(shards="s", out="o", merge=True)
    with pytest.raises(ConfigError, match="adapts the LLM, which --train projector"):
        TrainConfig(shards="s", out="o", train=["projector"], lora_rank=8)
    with pytest.raises(ConfigError, match="'qkv' match no linear layer LoRA adapts"):
        TrainConfig(shards="s", out="o", lora_rank=8, lora_targets=["q_proj,qkv"])
    with pytest.raises(ConfigError, match="--lora-alpha scales LoRA adapters"):
        TrainConfig(shards="s", out="o", lora_alpha=16)
    cfg = TrainConfig(shards="s", out="o", lora_rank=8, seed=3)
    assert cfg.recipe.lora == Lora(8, 16.0, 0.0, LORA_TARGETS, seed=3)  # LLaMA-Factory's alpha


@pytest.mark.slow(minutes=1)
def test_the_engine_holds_what_the_memory_model_charges_a_lora_recipe(tmp_path):
    """One bf16 step at PP=2 of InternVL's recipe (the ViT frozen, the projector trained in
    full, the LLM under LoRA): each stage's engine holds the memory model's bytes per trained
    parameter (the projector's, the adapters') within 2%, and its frozen weights at 2 bytes
    each (bf16, nothing else for them); each stage's parameter bytes in ``pipeline.json`` are
    those two sums, from the analytic model."""
    from vlmshard.model_sizes import bytes_per_param, weight_bytes_per_param

    folder = make_folder("internvl", str(tmp_path / "model"))
    shards = make_shards(folder, tmp_path, rows=ROWS, micro_batches=2, target_samples=3)
    run = tmp_path / "run"
    vlmshard_here("train", "--shards", shards, "--pp", "2", "--bounds", "0", "3", "8",
                  "--precision", "bf16", "--max-steps", "1", "--train", "projector", "llm",
                  "--lora-rank", str(RANK), "--no-save-checkpoints", "--out", str(run))
    (record,) = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    stages = json.loads((run / "pipeline.json").read_text())["stages"]
    trained_bytes, frozen_bytes = bytes_per_param("bf16", 1, "fp32", 1), weight_bytes_per_param()
    for rank in record["ranks"]:
        held = rank["engine_bytes"]
        assert held["params"] > 0 and held["frozen_params"] > 0, rank["stage"]
        assert held["total"] == pytest.approx(trained_bytes * held["params"], rel=0.02)
        assert held["frozen"] == frozen_bytes * held["frozen_params"]
        charged = stages[rank["stage"]]["memory"]["params"]
        assert charged == pytest.approx(trained_bytes * held["params"]
                                        + frozen_bytes * held["frozen_params"], rel=1e-6)
