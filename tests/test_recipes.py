"""The recipes users run: parts of the model frozen (``--train``, ``--freeze-embeddings``).

The reference is the ``transformers`` model with ``requires_grad`` set as LLaMA-Factory sets it
for ``freeze_vision_tower`` / ``freeze_multi_modal_projector`` / ``freeze_language_model``:
its ``_register_composite_model`` keys per model type
(LLaMA-Factory ``src/llamafactory/model/model_utils/visual.py``), matched on the parameters'
names here, independently of the trainer's layer list.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import vlmshard_here
from hf_reference import (
    ROWS,
    assert_grad_close,
    grad_floor,
    hf_loss_and_grads,
    make_folder,
    make_shards,
    pipeline_grads,
)

from vlmshard.errors import ConfigError
from vlmshard.recipe import Recipe
from vlmshard.shards.loader import ShardDataset
from vlmshard.train.config import TrainConfig
from vlmshard.train.hf_model import model_layers

# LLaMA-Factory's keys: the vision tower's and the projector's (``vision_model_keys``,
# ``projector_key``); the language model is ``language_model`` and ``lm_head``.
VISION = {"qwen2_vl": ("visual.patch_embed", "visual.blocks"),
          "qwen3_vl": ("visual.pos_embed", "visual.patch_embed", "visual.blocks",
                       "visual.deepstack_merger_list"),
          "internvl": ("vision_tower",)}
PROJECTOR = {"qwen2_vl": ("visual.merger",), "qwen3_vl": ("visual.merger",),
             "internvl": ("multi_modal_projector",)}
LANGUAGE = ("language_model", "lm_head")


def llamafactory_trains(family: str, parts: set[str], freeze_embeddings: bool = False):
    """Whether a ``transformers`` parameter of ``family`` trains when only ``parts`` do."""
    def trains(name: str) -> bool:
        name = name.removeprefix("model.")
        for part, keys in (("vit", VISION[family]), ("projector", PROJECTOR[family]),
                           ("llm", LANGUAGE)):
            if name.startswith(keys):
                # (a head tied to the embedding is the embedding's one parameter)
                embedding = name.startswith("language_model.embed_tokens")
                return part in parts and not (embedding and freeze_embeddings)
        raise AssertionError(f"{name} is in no part")
    return trains


def _weights(folder) -> dict[str, torch.Tensor]:
    """The parameters of the model a folder loads as, by their ``transformers`` names."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    return {name: p.detach() for name, p in model.named_parameters()}


def _losses(run) -> list[float]:
    with open(run / "train_log.jsonl") as f:
        return [json.loads(line)["loss"] for line in f]


# (family, --train, bounds): a stage 0 of a frozen ViT alone, which runs no backward (Qwen3-VL's
# DeepStack features crossing to stage 1 without a gradient); and InternVL's projector alone
# trained, where stage 1 holds the frozen LLM (its tied embedding and head among it), trains
# nothing and passes the gradient down
CASES = [("qwen2_vl", "projector,llm", [0, 2, 8]),
         ("qwen3_vl", "projector,llm", [0, 2, 11]),
         ("internvl", "projector", [0, 3, 8])]


@pytest.mark.slow(minutes=1.5)
@pytest.mark.parametrize("family, parts, bounds", CASES)
def test_a_frozen_part_trains_as_the_hf_model_with_the_same_requires_grad(family, parts,
                                                                          bounds, tmp_path):
    """PP=2 through DeepSpeed: step 0's loss and every trainable gradient equal the
    ``transformers`` model's with LLaMA-Factory's ``requires_grad`` (fp32, rtol 1e-4), no frozen
    weight has an optimizer state, and after 3 steps every frozen weight is bit-identical to
    the folder's and every trained one has moved."""
    folder = make_folder(family, str(tmp_path / "model"))
    shards = make_shards(folder, tmp_path, rows=ROWS, micro_batches=2, target_samples=3)
    run = tmp_path / "run"
    vlmshard_here("train", "--shards", shards, "--pp", "2", "--max-steps", "3", "--lr", "0.001",
                  "--warmup-steps", "0", "--max-grad-norm", "0", "--checkpoint-every", "1",
                  "--bounds", *map(str, bounds), "--train", parts, "--out", str(run))
    model = model_layers(folder)
    batches = list(ShardDataset(shards, pixel_dtype=torch.float32))[:2]
    trains = llamafactory_trains(family, set(parts.split(",")))
    loss, count, ref_grads = hf_loss_and_grads(folder, batches, model.geometry.tokens_per_tile,
                                               model.geometry.pixel_rows_per_tile, trains)
    assert _losses(run)[0] == pytest.approx(loss / count, rel=1e-5)
    grads = {k: v for g in pipeline_grads(run, model).values() for k, v in g.items()}
    assert set(grads) == set(ref_grads)  # the optimizer holds the trained weights only
    assert ref_grads and all(trains(n) for n in ref_grads)
    floor = grad_floor(ref_grads)
    for name, grad in ref_grads.items():
        assert_grad_close(name, grads[name] * count, grad, floor)

    before, after = _weights(tmp_path / "model"), _weights(run / "hf")
    assert before.keys() == after.keys()
    frozen = [n for n in before if not trains(n)]
    assert frozen
    for name in before:
        assert torch.equal(before[name], after[name]) == (name in frozen), name


@pytest.mark.slow(minutes=1.5)
def test_zero_2_and_3_train_a_frozen_vit_as_the_pipeline_does(tmp_path):
    """At PP=1 under ZeRO-2 and ZeRO-3 (every weight split): the same 3 losses as the pipeline
    engine's PP=2 run of the recipe, the same trained weights, and the frozen ones untouched."""
    folder = make_folder("qwen2_vl", str(tmp_path / "model"))
    shards = make_shards(folder, tmp_path, rows=ROWS, micro_batches=2, target_samples=3)
    common = ["--shards", shards, "--max-steps", "3", "--lr", "0.001", "--warmup-steps", "0",
              "--train", "projector", "llm"]
    runs = {"pipeline": ["--pp", "2"], "zero2": ["--zero", "2"],
            "zero3": ["--zero", "3", "--zero3-persistence-threshold", "0"]}
    for name, args in runs.items():
        vlmshard_here("train", *common, *args, "--out", str(tmp_path / name))
    trains = llamafactory_trains("qwen2_vl", {"projector", "llm"})
    before = _weights(tmp_path / "model")
    reference = _weights(tmp_path / "pipeline" / "hf")
    for name in ("zero2", "zero3"):
        assert _losses(tmp_path / name) == pytest.approx(_losses(tmp_path / "pipeline"),
                                                         rel=1e-5)
        after = _weights(tmp_path / name / "hf")
        for key, tensor in after.items():
            if trains(key):
                torch.testing.assert_close(tensor, reference[key], rtol=1e-5, atol=1e-4)
            else:
                assert torch.equal(tensor, before[key]), (name, key)


def test_a_recipe_names_each_layers_mode():
    """Frozen layers before the first trained one run forward only; frozen ones after it also
    pass their input's gradient; a tied head freezes with the embedding."""
    names = ["vit_embed", "vit_block_0", "projector", "embed_tokens", "llm_block_0",
             "final_norm", "head"]
    assert Recipe(("projector", "llm")).modes(names) == [
        "forward", "forward", "train", "train", "train", "train", "train"]
    assert Recipe(("projector",)).modes(names) == [
        "forward", "forward", "train", "input_grad", "input_grad", "input_grad", "input_grad"]
    assert Recipe(("llm",), freeze_embeddings=True).modes(names, tied=True) == [
        "forward", "forward", "forward", "forward", "train", "train", "input_grad"]
    assert Recipe(("llm",), freeze_embeddings=True).modes(names, tied=False)[-1] == "train"


def test_a_recipe_that_trains_nothing_or_no_part_is_one_line():
    with pytest.raises(ConfigError, match="'audio' is no part of a model"):
        TrainConfig(shards="s", out="o", train=["vit", "audio"])
    with pytest.raises(ConfigError, match="leaves no weight of the model to train"):
        Recipe(("vit",)).modes(["embed_tokens", "llm_block_0", "head"])
    # comma- and space-separated alike, each part once
    assert TrainConfig(shards="s", out="o", train=["projector,llm", "llm"]).recipe == Recipe(
        ("projector", "llm"))


@pytest.mark.parametrize("mode", ["forward", "input_grad", "train"])
def test_a_layers_flops_in_each_mode_are_what_autograd_runs(mode, tmp_path):
    """A Qwen2-VL decoder layer's matrix products through forward and backward, counted by
    torch's FlopCounterMode as autograd runs them: the forward alone (frozen, nothing trained
    before it: under no_grad), the input's gradient beside it (frozen weights), or both
    gradients; equal to the analytic forward FLOPs in the mode (``executed_flops``)."""
    from torch.utils.flop_counter import FlopCounterMode

    from vlmshard.families import model_sizes
    from vlmshard.io import read_json
    from vlmshard.model_sizes import executed_flops, layer_work

    folder = make_folder("qwen2_vl", str(tmp_path / "model"))
    layers = model_layers(folder)
    block = layers.build_layer(layers.names.index("llm_block_0")).layer
    block.requires_grad_(mode == "train")
    rotary = layers.meta.model.language_model.rotary_emb
    tokens = 29
    hidden = torch.randn(1, tokens, layers.config.get_text_config().hidden_size,
                         requires_grad=mode != "forward")
    positions = torch.arange(tokens).expand(3, 1, tokens)
    with torch.no_grad():
        rope = type(rotary)(rotary.config)(hidden, positions)
    with FlopCounterMode(display=False) as counter, torch.set_grad_enabled(mode != "forward"):
        out = block(hidden, attention_mask=None, position_embeddings=rope, use_cache=False)
        out = out[0] if isinstance(out, tuple) else out
        if mode != "forward":
            out.sum().backward()
    matmuls = sum(n for op, n in counter.get_flop_counts()["Global"].items()
                  if op.__name__.split(".")[0] in ("mm", "addmm", "bmm"))
    work = {w.name: w for w in layer_work(model_sizes(read_json(f"{folder}/config.json"),
                                                      folder))}["llm_block_0"]
    assert matmuls == executed_flops(work.flops, mode).tokens * tokens
    assert matmuls == {"forward": 1, "input_grad": 2, "train": 3}[mode] * work.flops.tokens \
        * tokens


def test_pack_costs_a_frozen_vit_at_its_forward(tmp_path):
    """``pack --train projector llm`` on Qwen2-VL stats: a_v is the ViT's forward alone plus
    the trained merger's forward and backward, about a third of training both, recorded with
    the recipe in plan.json's cost model; the LLM's coefficients are unchanged."""
    from vlmshard.families import model_sizes
    from vlmshard.io import read_json
    from vlmshard.model_sizes import layer_work
    from vlmshard.packing.config import PackConfig
    from vlmshard.packing.plan import run_pack

    folder = make_folder("qwen2_vl", str(tmp_path / "model"))
    make_shards(folder, tmp_path, rows=ROWS)
    costs = {}
    for name, parts in (("full", ["vit", "projector", "llm"]), ("frozen", ["projector,llm"])):
        run_pack(PackConfig(stats=str(tmp_path / "pre"), dp=1, out=str(tmp_path / name),
                            train=parts))
        costs[name] = read_json(str(tmp_path / name / "plan.json"))["cost_model"]
    work = layer_work(model_sizes(read_json(f"{folder}/config.json"), folder))
    vit = sum(w.flops.tiles for w in work if w.name.startswith("vit_"))
    merger = next(w.flops.tiles for w in work if w.name == "projector_merge")
    embed = next(w.flops.tiles for w in work if w.name == "vit_embed")
    full, frozen = costs["full"], costs["frozen"]
    # trained, the patch embedding computes no gradient for its pixels: its weights' alone
    assert full["a_v"] == pytest.approx(3 * (vit + merger) - embed)
    assert frozen["a_v"] == pytest.approx(vit + 3 * merger)
    assert frozen["a_v_share"] == pytest.approx(frozen["a_v"] / full["a_v"])
    assert 1 / 3 < frozen["a_v_share"] < 1
    # at Qwen2-VL-2B's sizes, where the merger is small beside the ViT: about a third
    from vlmshard.families import presets
    from vlmshard.packing.cost import CostModel

    share = CostModel.from_sizes(presets()["qwen2-vl-2b"], Recipe(("projector", "llm")))
    assert 1 / 3 < share.a_v_share < 0.35
    assert (frozen["recipe"], full["recipe"], full["a_v_share"]) == (
        "projector,llm", "vit,projector,llm", 1.0)
    assert (frozen["a_t"], frozen["b"]) == (full["a_t"], full["b"])


def test_a_frozen_vit_moves_the_partition_and_its_stage_runs_no_backward():
    """Qwen3-VL-8B on 4 stages of an 80 GB device: with the ViT frozen the search puts more
    layers on the first stage, which holds the ViT's weights alone (no gradients or optimizer
    states) and runs no backward."""
    from vlmshard.families import presets
    from vlmshard.model_sizes import CostTerms, bytes_per_param, layer_work, weight_bytes_per_param
    from vlmshard.partition import Machine, analytic_layer_costs, search_partition

    model = presets()["qwen3-vl-8b"]
    work = layer_work(model)
    size = CostTerms(tiles=2048, tokens=8192, squares=8192 ** 2 / 4, supervised=4096)
    machine = Machine.for_device(80 * 2**30)
    bounds = {}
    for name, recipe in (("full", Recipe()), ("frozen", Recipe(("projector", "llm")))):
        modes = recipe.modes(model.layer_names())
        layers = analytic_layer_costs(work, time_size=size, memory_size=size, flops_per_s=1.0,
                                      bytes_per_param=bytes_per_param(), modes=modes,
                                      frozen_bytes_per_param=weight_bytes_per_param())
        found = search_partition(layers, 4, machine)
        bounds[name] = found.bounds
        if name == "frozen":
            vit = [i for i, n in enumerate(model.layer_names()) if n.startswith("vit_")]
            assert all(layers[i].backward_s == 0 and layers[i].activation_bytes == 0
                       and layers[i].param_bytes == work[i].params * 2 for i in vit)
            assert set(vit) <= set(range(found.bounds[1]))
    assert bounds["frozen"][1] > bounds["full"][1], bounds


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "internvl"])
def test_a_transformers_model_is_frozen_as_llamafactory_freezes_it(family, tmp_path):
    """``as_recipe`` (for a trainer of one's own, and the GPU bench's peers) leaves
    trainable exactly the parameters LLaMA-Factory's keys name, for each recipe."""
    from transformers import AutoModelForImageTextToText

    folder = make_folder(family, str(tmp_path / "model"))
    model = AutoModelForImageTextToText.from_pretrained(folder)
    for parts, freeze in ((("projector", "llm"), False), (("vit",), False), (("llm",), True),
                          (("projector",), False)):
        assert model_layers(folder, recipe=Recipe(parts, freeze)).as_recipe(model) is model
        trains = llamafactory_trains(family, set(parts), freeze)
        assert {n for n, p in model.named_parameters() if p.requires_grad} == {
            n for n, _ in model.named_parameters() if trains(n)}, (parts, freeze)


def test_the_profile_measures_each_layer_as_the_recipe_runs_it(tmp_path):
    """``train profile``'s layer runs with the ViT frozen: its layers take no backward and keep
    nothing (autograd's saved-tensor hooks see none); the LLM's, after the trained projector,
    measure their backward; frozen weights are charged their storage alone."""
    from vlmshard.train.profile import profile_layers

    folder = make_folder("qwen2_vl", str(tmp_path / "model"))
    shards = make_shards(folder, tmp_path, rows=ROWS)
    model = model_layers(folder, recipe=Recipe(("projector", "llm")))
    batch = list(ShardDataset(shards, pixel_dtype=torch.float32))[:1]
    profile = profile_layers(model, batch, repeats=1, warmup=0, param_bytes=16, frozen_bytes=4)
    for layer, mode in zip(profile.layers, model.modes):
        if mode == "forward":
            assert (layer.backward_s, layer.activation_bytes, layer.has_backward) == (0, 0, False)
            assert layer.param_bytes == 4 * model.parameter_count(model.names.index(layer.name))
        else:
            assert layer.has_backward and layer.param_bytes == 16 * model.parameter_count(
                model.names.index(layer.name))
    assert [m for m in model.modes[:2]] == ["forward", "forward"]
    assert all(c.backward_s > 0 for c in profile.layers[model.names.index("llm_block_0"):])


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "internvl"])
def test_the_memory_model_holds_each_recipe_to_what_autograd_keeps(family, tmp_path):
    """Each layer run alone in bf16 as each recipe runs it, held as a full fine-tune's are
    (``test_model.check_memory_model``: activations within 15% of what autograd's saved-tensor
    hooks see, selective recompute's too, the transient never below torch's memory tracker):
    the ViT frozen (a forward-only prefix), the projector alone trained (every LLM layer
    frozen after it: its input's gradient only), and LoRA on the LLM (PEFT's adapters beside
    frozen weights)."""
    from test_model import check_memory_model

    from vlmshard.recipe import Lora

    folder = make_folder(family, str(tmp_path / "model"))
    shards = make_shards(folder, tmp_path, target_samples=3, micro_batches=2)
    for recipe in (Recipe(("projector", "llm")), Recipe(("projector",)),
                   Recipe(("llm",), lora=Lora(4, 8.0))):
        check_memory_model(model_layers(folder, recipe=recipe), shards, "cpu")
