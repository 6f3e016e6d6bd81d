"""The analytic model (``vlmshard.model_sizes``) counts the parameters the ``transformers``
modules hold, layer kind by layer kind: the expected counts come from instantiating the HF
model (on the meta device: no memory) and counting, never from the formulas under test."""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import replace

import pytest
import torch
from hf_reference import FAMILIES, make_folder

from vlmshard.errors import ConfigError
from vlmshard.families import model_sizes, presets, tiny_folder
from vlmshard.io import read_json
from vlmshard.model_sizes import (
    ZERO3_MAX_REUSE_DISTANCE,
    ZERO3_PERSISTENCE_THRESHOLD,
    ZERO3_PREFETCH_BUCKET,
    ZERO3_REDUCE_BUCKET,
    LLMConfig,
    ModelConfig,
    Zero3Weights,
    CostTerms,
    layer_work,
    trainer_layer_work,
    zero3_fixed_bytes,
)
from vlmshard.partition import analytic_layer_costs, stage_param_bytes

# Qwen3-VL's published ViT and rotary settings, the same in every size
VIT = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
           spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
           deepstack_visual_indexes=[8, 16, 24])
ROPE = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
        "mrope_interleaved": True}


@pytest.mark.parametrize("model_type", FAMILIES + ("internvl_final_norm",))
def test_each_layer_kind_counts_the_hf_modules_parameters(model_type, tmp_path):
    """Every trainer layer (what a stage holds) as the analytic model counts it, against the
    transformers modules it builds, for every family the trainer runs: InternViT's class token,
    layer scales and bias-free q/k/v, its final LayerNorm where it has one; Qwen2's q/k/v
    biases; Qwen2-VL's bias-free patch embedding; Qwen2.5-VL's SwiGLU MLPs and RMSNorms;
    Qwen3-VL's learned position table, plain and DeepStack ViT blocks (a block and its merger),
    Qwen3 decoder layers (explicit head_dim, q/k norms; dense or router + every expert); the
    merger or projector; the head."""
    from vlmshard.train.hf_model import model_layers

    folder = make_folder(model_type, str(tmp_path / "model"))
    layers = model_layers(folder)
    with open(f"{folder}/config.json") as f:
        sizes = model_sizes(json.load(f), folder)
    # per trainer layer (what a stage partition holds), and over the whole model
    counted = [layers.parameter_count(i) for i in range(len(layers.names))]
    work = trainer_layer_work(layers.names, sizes)
    assert [w.params for w in work] == counted
    assert sum(counted) == sum(w.params for w in layer_work(sizes))
    # one stage holding every layer holds each parameter once, a tied table too (InternVL's
    # and Gemma 3's heads are their token embeddings): as many as the HF model has
    assert sizes.llm.tied_embeddings == any(d.tied_key for d in layers.defs)
    assert _stage_params(work) == sum(p.numel() for p in layers.meta.parameters())
    if not model_type.startswith("qwen3_vl"):
        return
    kinds = {d.kind for d in layers.defs}
    assert {"vit_block", "vit_block_deepstack", "llm_block_deepstack"} <= kinds
    assert ("llm_block_moe" if model_type.endswith("moe") else "llm_block") in kinds


def _stage_params(work, bounds=None) -> list[int] | int:
    """Parameters one stage holds (or each stage of ``bounds``), as the memory model counts
    them (one byte a parameter)."""
    costs = analytic_layer_costs(work, time_size=CostTerms(1, 1), memory_size=CostTerms(1, 1),
                                 flops_per_s=1.0, bytes_per_param=1)
    if bounds is None:
        return stage_param_bytes(costs, 0, len(costs))
    return [stage_param_bytes(costs, a, b) for a, b in zip(bounds, bounds[1:])]


def test_a_tied_head_is_held_once_by_a_stage_holding_both(tmp_path):
    """Qwen3-VL-2B ties its LM head to the token embedding, Qwen3-VL-8B does not: the memory
    model reads it as ``transformers`` builds the model, and a stage holding both layers holds
    the table once (the HF model's parameters), two stages a copy each (as DeepSpeed's tied
    layers are held: 151,936 x 2,048 = 311M more for Qwen3-VL-2B's sizes)."""
    from vlmshard.train.hf_model import model_layers

    for tied in (True, False):
        folder = tiny_folder("qwen3_vl", str(tmp_path / f"tied-{tied}"),
                             tie_word_embeddings=tied)
        layers = model_layers(folder)
        hf = layers.meta
        assert (hf.lm_head.weight is hf.get_input_embeddings().weight) == tied
        sizes = model_sizes(read_json(os.path.join(folder, "config.json")), folder)
        assert sizes.llm.tied_embeddings == tied
        work = trainer_layer_work(layers.names, sizes)
        real = sum(p.numel() for p in hf.parameters())
        table = hf.get_input_embeddings().weight.numel()
        assert _stage_params(work) == real
        head = layers.names.index("head")
        assert sum(_stage_params(work, [0, head, len(work)])) == real + table * tied
    # Qwen3-VL-2B's LLM (Qwen3-1.7B's sizes, tied), the head on a stage of its own
    llm = replace(presets()["qwen3-vl-8b"].llm, hidden=2048, layers=28, heads=16,
                  intermediate=6144, tied_embeddings=True)
    work = layer_work(ModelConfig(llm=llm))
    assert sum(_stage_params(work, [0, len(work) - 1, len(work)])) - _stage_params(work) \
        == 151_936 * 2_048


def test_a_moe_layer_costs_its_active_experts(tmp_path):
    """The forward FLOPs of a Qwen3-VL-MoE decoder layer's matrix products, counted by torch
    while transformers runs it on real tokens (each through its top-k experts), equal the
    analytic per-token FLOPs: attention projections, the router and k experts, not all of them."""
    from torch.utils.flop_counter import FlopCounterMode

    from vlmshard.train.hf_model import model_layers

    folder = tiny_folder("qwen3_vl_moe", str(tmp_path / "model"))
    with open(f"{folder}/config.json") as f:
        config = json.load(f)
    layers = model_layers(folder)
    block = layers.build_layer(layers.names.index("llm_block_2")).layer
    # the experts one by one (torch's flop counter does not count a grouped matmul)
    block.mlp.experts.config._experts_implementation = "eager"
    rotary = layers.meta.model.language_model.rotary_emb
    tokens = 37
    hidden = torch.randn(1, tokens, config["text_config"]["hidden_size"])
    positions = torch.arange(tokens).expand(3, 1, tokens)
    with torch.no_grad():
        rope = type(rotary)(rotary.config)(hidden, positions)
        with FlopCounterMode(display=False) as counter:
            block(hidden, attention_mask=None, position_embeddings=rope, use_cache=False)
    matmuls = sum(n for op, n in counter.get_flop_counts()["Global"].items()
                  if op.__name__.split(".")[0] in ("mm", "addmm", "bmm"))
    work = {w.name: w for w in layer_work(model_sizes(config, folder))}["llm_block_2"]
    assert matmuls == work.flops.tokens * tokens
    assert work.flops.tokens < 2 * work.params  # k of the experts, not every parameter


def test_the_qwen3_vl_30b_a3b_preset_is_the_published_model():
    """The preset holds the parameters transformers builds from Qwen3-VL-30B-A3B-Instruct's
    published config.json (about 31B), and a token runs through about 3B of them."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    config = Qwen3VLMoeConfig(
        text_config=dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                         num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                         head_dim=128, num_experts=128, num_experts_per_tok=8,
                         moe_intermediate_size=768, decoder_sparse_step=1, mlp_only_layers=[],
                         rope_parameters=ROPE),
        vision_config={**VIT, "out_hidden_size": 2048},
        tie_word_embeddings=False)
    with torch.device("meta"):
        model = Qwen3VLMoeForConditionalGeneration(config)
    real = sum(p.numel() for p in model.parameters())
    preset = presets()["qwen3-vl-30b-a3b"]
    work = layer_work(preset)
    assert sum(w.params for w in work) == real
    assert real == pytest.approx(31e9, rel=0.02)
    llm = [w for w in work if w.name.startswith("llm_block")]
    active = sum(w.flops.tokens for w in llm) / 2  # a multiply-add per active parameter
    assert active == pytest.approx(3e9, rel=0.15)
    assert model_sizes(config.to_dict(), "qwen3-vl-30b-a3b") == preset


def test_an_explicit_head_dim_is_counted():
    """InternVL3.5-1B's LLM (Qwen3-0.6B: 16 heads of 128 over a hidden size of 1024): one
    decoder layer of transformers holds 15.73M parameters, not the 12.58M hidden / heads gives."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    from vlmshard.families.internvl import LLM_FEATURES

    sizes = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128)
    with torch.device("meta"):
        layer = Qwen3DecoderLayer(Qwen3Config(**sizes), 0)
    real = sum(p.numel() for p in layer.parameters())
    llm = LLMConfig.from_hf_config(sizes, LLM_FEATURES["qwen3"])
    work = {w.name: w.params for w in layer_work(ModelConfig(llm=llm))}
    assert work["llm_block_0"] == real
    assert real == pytest.approx(15.73e6, rel=1e-3)


def test_every_projector_a_config_names_has_its_builder():
    """A config names its projector by kind (``PROJECTOR_KINDS``, which ``validate`` checks),
    and the cost model has a builder for each of those kinds and no other (``PROJECTORS``)."""
    from vlmshard.model_sizes import PROJECTOR_KINDS, PROJECTORS

    assert tuple(PROJECTORS) == PROJECTOR_KINDS
    for kind in PROJECTOR_KINDS:
        ModelConfig(projector=kind).validate()
    with pytest.raises(ConfigError, match="projector 'conv' is none of mlp, merger, pool"):
        ModelConfig(projector="conv").validate()


def _qwen3_vl_8b_config():
    """Qwen3-VL-8B-Instruct's published config.json, as ``transformers`` reads it."""
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config=dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                         num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, rope_parameters=ROPE),
        vision_config={**VIT, "out_hidden_size": 4096},
        tie_word_embeddings=False)


def test_the_qwen3_vl_8b_preset_is_the_published_model():
    """The preset's layers hold as many parameters as ``transformers`` builds from
    Qwen3-VL-8B-Instruct's published config.json."""
    from transformers import Qwen3VLForConditionalGeneration

    config = _qwen3_vl_8b_config()
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(config)
    real = sum(p.numel() for p in model.parameters())
    preset = presets()["qwen3-vl-8b"]
    assert sum(w.params for w in layer_work(preset)) == real
    assert model_sizes(config.to_dict(), "qwen3-vl-8b") == preset


def test_the_family_states_the_llm_features_whatever_its_model_type_is_called():
    """The LLM's features that config.json does not state (Qwen3's q/k norms here) are the
    family's word, not guessed from how the model_type is spelled: Qwen3-VL-8B's config.json
    under model_type names of its own (a user's family built on Qwen3-VL) reads as the preset,
    whose parameters ``transformers`` builds (the test above)."""
    from vlmshard.families.qwen3vl import Qwen3VL

    config = _qwen3_vl_8b_config().to_dict()
    config["model_type"], config["text_config"]["model_type"] = "my_vlm", "my_vlm_text"
    assert Qwen3VL().model_sizes(config, "qwen3-vl-8b") == presets()["qwen3-vl-8b"]


@pytest.mark.parametrize("name, preset, window, linear", [
    ("gemma-3-4b-it.json", "gemma-3-4b", 1024, 0), ("qwen3.5-0.8b.json", None, 0, 18)])
def test_published_configs_read_with_transformers_defaults(name, preset, window, linear):
    """A published config.json states only what differs from transformers' defaults (Gemma 3's
    has no head counts at all): its sizes are read as transformers reads the file, layer kinds
    included. Gemma 3 4B's equal the preset's; Qwen3.5-0.8B has 18 Gated DeltaNet layers of 24."""
    from helpers import REPO

    with open(os.path.join(REPO, "tests", "data", "configs", name)) as f:
        config = json.load(f)
    sizes = model_sizes(config, name)
    assert sizes.llm.sliding_window == window and len(sizes.llm.linear_layers) == linear
    if preset:
        assert sizes.llm == presets()[preset].llm and sizes.vision == presets()[preset].vision
        assert sizes.tokens_per_tile == presets()[preset].tokens_per_tile == 256


def test_zero3_settings_are_deepspeeds_defaults():
    """The trainer leaves these at DeepSpeed's defaults; the memory model charges them."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    c = DeepSpeedZeroConfig()
    assert (c.reduce_bucket_size, c.prefetch_bucket_size, c.max_reuse_distance,
            c.param_persistence_threshold) == (ZERO3_REDUCE_BUCKET, ZERO3_PREFETCH_BUCKET,
                                               ZERO3_MAX_REUSE_DISTANCE,
                                               ZERO3_PERSISTENCE_THRESHOLD)


def test_zero3_fixed_bytes_by_hand():
    """A Qwen2.5-VL-7B-like model at DP=8 in bf16 (8e9 weights, 1e6 of them under the
    threshold, the 152,064 x 3,584 embedding the largest module), and a model smaller than
    the reuse distance, which stays gathered whole."""
    big = Zero3Weights(8_000_000_000, 1_000_000, 152_064 * 3_584)
    assert zero3_fixed_bytes(big, "bf16", 8) == {
        "reduce_bucket": 1_000_000_000,  # 5e8 elements
        "gathered": 2 * (1_000_000_000 + 50_000_000 + 544_997_376),  # reuse + prefetch + embed
        "gradient": 2 * 544_997_376,
        "persistent": 1_750_000}  # 2 bytes x 1e6, less this rank's eighth
    small = Zero3Weights(3_000_000, 0, 1_000_000)
    assert zero3_fixed_bytes(small, "fp32", 2) == {
        "reduce_bucket": 2_000_000_000, "gathered": 12_000_000, "gradient": 4_000_000,
        "persistent": 0}


def test_the_kernels_that_run_change_what_a_layer_keeps_by_a_hand_count():
    """What ``Saves`` changes in each layer, counted by hand from what the kernels save for
    backward (liger-kernel 0.8.5's ``ctx.save_for_backward``; torch's varlen ``setup_context``):
    Liger's RMSNorm keeps its bf16 input and fp32 1/rms where ``transformers``' keeps an fp32
    copy of its input and the bf16 normalized values (4 bytes less an element), its SwiGLU keeps
    gate and up but not the activation (2 bytes an intermediate channel); a Qwen ViT's one
    varlen call keeps a copy of v (one hidden) where SDPA per image kept views holding the fused
    qkv output (three) and the projection the images' outputs concatenated (one)."""

    from vlmshard.model_sizes import Saves

    def kept(config, saves, name):
        return {w.name: w.activation_bytes for w in layer_work(config, saves)}[name]

    qwen3 = presets()["qwen3-vl-8b"]
    t, v = qwen3.llm, qwen3.vision
    plain, liger = Saves(), Saves(liger_llm=True)
    norms = 2 * t.hidden + t.heads * t.head_size + t.kv_heads * t.head_size  # with q/k norms
    assert (kept(qwen3, plain, "llm_block_0").tokens - kept(qwen3, liger, "llm_block_0").tokens
            == 4 * norms + 2 * t.intermediate)
    assert kept(qwen3, plain, "head").tokens - kept(qwen3, liger, "head").tokens == 4 * t.hidden
    patches = qwen3.patches_per_tile
    one_call = Saves(vit_one_call=True)
    for block in ("vit_block_0", "vit_block_8"):  # a plain block and a DeepStack one
        assert (kept(qwen3, plain, block).tiles - kept(qwen3, one_call, block).tiles
                == patches * 2 * 3 * v.hidden)
    assert kept(qwen3, plain, "llm_block_0") == kept(qwen3, one_call, "llm_block_0")
    # K/V heads repeated to the query heads: the kernel keeps k and v as wide as q
    assert (kept(qwen3, Saves(kv_repeated=True), "llm_block_0").tokens
            - kept(qwen3, plain, "llm_block_0").tokens
            == 2 * 2 * (t.heads - t.kv_heads) * t.head_size)
    # a ViT of RMSNorms and SwiGLU MLPs (Qwen2.5-VL's): Liger's in both
    gated = replace(qwen3, vision=replace(v, rms_norm=True, gated_mlp=True))
    mlp = int(v.hidden * v.mlp_ratio)
    assert (kept(gated, plain, "vit_block_0").tiles
            - kept(gated, Saves(liger_vit=True), "vit_block_0").tiles
            == patches * (2 * 4 * v.hidden + 2 * mlp))
    assert kept(qwen3, plain, "vit_block_0") == kept(qwen3, Saves(liger_vit=True), "vit_block_0")


def test_a_sequence_parallel_rank_keeps_and_holds_by_a_hand_count():
    """What ``Saves.sp`` adds to a rank's layers, counted by hand from the exchanges
    (``vlmshard.train.sequence_parallel``): Qwen3-VL-8B's 8 key/value heads split over SP 8 as
    they come (nothing added) and are repeated to 16 at SP 16, where the kernel keeps k and v
    and its backward makes their gradients 16 heads wide (bf16: 2 bytes an element); the token
    embedding's media exchange keeps two int64 indices per image token (bounded per token) and
    holds, per own tile, the rows it sends, and per token those it gets and their order, of the
    features and each of the 3 DeepStack levels (measured: ``test_sp_memory.py``)."""
    from vlmshard.model_sizes import Saves
    from vlmshard.model_sizes.attention import attention

    qwen3 = presets()["qwen3-vl-8b"]
    t = qwen3.llm

    def work(sp):
        return {w.name: w for w in layer_work(qwen3, Saves(sp=sp))}

    one, eight, sixteen = work(1), work(8), work(16)
    assert one == {w.name: w for w in layer_work(qwen3)}
    assert eight["llm_block_0"] == one["llm_block_0"]
    wider = 2 * 2 * (16 - t.kv_heads) * t.head_size
    assert (sixteen["llm_block_0"].activation_bytes.tokens
            - one["llm_block_0"].activation_bytes.tokens == wider)
    # the attention's own (the block holds the widest of its mixers')
    assert attention(t, Saves(sp=16)).transient - attention(t, Saves()).transient == wider
    embed = {n: trainer_layer_work(["vit_embed", *[f"vit_block_{i}" for i in range(27)],
                                    "projector", "embed_tokens",
                                    *[f"llm_block_{i}" for i in range(t.layers)], "final_norm",
                                    "head"], qwen3, Saves(sp=n))[29] for n in (1, 2)}
    assert len(qwen3.vision.deepstack) == 3 and qwen3.tokens_per_tile == 1
    extra = [getattr(embed[2], f) + getattr(embed[1], f).scaled(-1)
             for f in ("activation_bytes", "transient_bytes")]
    assert extra == [CostTerms(tokens=16), CostTerms(tiles=4 * 2 * t.hidden,
                                                     tokens=2 * 4 * 2 * t.hidden)]


@pytest.mark.parametrize("model_type, vit_liger", [("qwen3_vl", False), ("qwen2_5_vl", True)])
def test_a_model_says_what_its_kernels_keep(model_type, vit_liger, tmp_path):
    """``ModelLayers.saves`` from the backend and switches a rank builds with: the one varlen
    call only on torch's varlen kernel (SDPA splits per image, and so does ``--sdpa-cudnn``),
    Liger's counts only where Liger runs (not in compiled blocks), and in the ViT only where
    its blocks have modules Liger swaps: Qwen2.5-VL's RMSNorms and SwiGLU MLPs, not Qwen3-VL's
    LayerNorms and GELU MLPs; and in the projector (never compiled) where its norm is an
    RMSNorm: Qwen2.5-VL's merger, not Qwen3-VL's."""
    from vlmshard.model_sizes import Saves
    from vlmshard.train.hf_model import model_layers
    from vlmshard.train.kernels import Kernels

    from torch.nn.attention.varlen import varlen_attn

    folder = make_folder(model_type, str(tmp_path / "model"))
    assert model_layers(folder, "sdpa", Kernels()).saves() == Saves()
    # torch's varlen kernel takes grouped-query heads from 2.12 on; before, they are repeated
    repeated = "enable_gqa" not in inspect.signature(varlen_attn).parameters
    assert model_layers(folder, "varlen", Kernels(liger=True)).saves() == Saves(
        vit_one_call=True, liger_llm=True, liger_vit=vit_liger, liger_projector=vit_liger,
        kv_repeated=repeated)
    assert model_layers(folder, "varlen", Kernels(vit_varlen=False)).saves() == Saves(
        kv_repeated=repeated)
    assert model_layers(folder, "varlen", Kernels(sdpa_cudnn=True)).saves() == Saves(
        kv_repeated=repeated)
    assert model_layers(folder, "sdpa", Kernels(liger=True, compile_blocks=("llm", "vit"))
                        ).saves() == Saves(liger_projector=vit_liger)
    assert (model_layers(folder, "sdpa", Kernels(liger=True)).analytic_work()
            == model_sizes_work(folder, Saves(liger_llm=True, liger_vit=vit_liger,
                                              liger_projector=vit_liger)))


def model_sizes_work(folder: str, saves) -> list:
    """The analytic work of the trainer's layers of ``folder`` keeping what ``saves`` says."""
    from vlmshard.train.hf_model import model_layers

    with open(os.path.join(folder, "config.json")) as f:
        sizes = model_sizes(json.load(f), folder)
    return trainer_layer_work(model_layers(folder).names, sizes, saves)


# Images and videos of several patch grids (t, h, w): windows cut at the edge, a side a whole
# number of windows, a video of two temporal steps, a single tile
GRIDS = [(1, 16, 20), (1, 8, 8), (2, 12, 6), (1, 2, 2), (3, 10, 18)]


def test_a_qwen_vit_attention_size_is_the_square_of_each_span_transformers_makes():
    """Σ P² over the spans transformers' own helpers cut a micro-batch's patches into: each
    image and each temporal step of a video (``get_vision_cu_seqlens``), and Qwen2.5-VL's
    windows of 112 px (``get_vision_window_index``: 4 × 4 merged patches of 2 × 2)."""
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_window_index

    from vlmshard.model_sizes import VisionConfig, vit_attention_size

    grids = torch.tensor(GRIDS)
    images = get_vision_cu_seqlens(grids).diff()
    windows = get_vision_window_index(grids, 2, 112, 14)[1].diff()
    vision = VisionConfig(image_size=28, patch_size=14, fused_qkv=True, window=4)
    assert vit_attention_size(vision, GRIDS) == CostTerms(
        vit_squares=int((images ** 2).sum()), vit_windows=int((windows ** 2).sum()))
    # a ViT attending within each tile (InternViT's, Gemma's SigLIP) counts it per tile
    assert vit_attention_size(replace(vision, fused_qkv=False, window=0), GRIDS) == CostTerms()


@pytest.mark.parametrize("model_type", [f for f in FAMILIES if f.startswith("qwen")])
def test_a_qwen_vit_attention_flops_are_those_transformers_runs(model_type, tmp_path):
    """The FLOPs of the attention products (q·kᵀ, and its softmax times v) a Qwen ViT runs in
    ``transformers`` on images and videos of several grids, counted by torch's FlopCounterMode
    in eager attention (batched matmuls; the projections are plain ones), equal the analytic
    model's ViT blocks at the grids' ``vit_attention_size``: per image or temporal step, and
    within windows on Qwen2.5-VL's windowed blocks."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForImageTextToText

    from vlmshard.model_sizes import vit_attention_size

    folder = make_folder(model_type, str(tmp_path / "model"))
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32,
                                                        attn_implementation="eager")
    visual = model.model.visual
    config = visual.config
    merge = config.spatial_merge_size
    grids = [(t, h * merge // 2, w * merge // 2) for t, h, w in GRIDS]  # whole merged patches
    width = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), width)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        visual(pixels, grid_thw=torch.tensor(grids))
    batched = sum(n for op, n in counter.get_flop_counts()["Global"].items()
                  if op.__name__.split(".")[0] == "bmm")
    sizes = model_sizes(read_json(os.path.join(folder, "config.json")), folder)
    size = vit_attention_size(sizes.vision, grids)
    vit = [w for w in layer_work(sizes) if w.name.startswith("vit_block")]
    assert batched == sum(w.flops.dot(size) for w in vit) > 0
    assert (size.vit_windows > 0) == (model_type == "qwen2_5_vl")
