"""The pipeline layers (what each DeepSpeed stage runs) on packed micro-batches equal the
``transformers`` model itself run on each sample alone: loss and gradients, for InternVL,
Qwen2-VL and Qwen2.5-VL; padding costs no compute; packed attention equals per-sample attention.
Every micro-batch comes from real shards through the real loader."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from hf_reference import (
    FAMILIES,
    assert_grad_close,
    grad_floor,
    hf_loss_and_grads,
    make_folder,
    make_shards,
)
from torch.utils.flop_counter import FlopCounterMode

from vlmshard.shards.loader import ShardDataset
from vlmshard.shards.model_inputs import next_token_targets, supervised_tokens
from vlmshard.train.attention import Spans, supports_runs
from vlmshard.train.hf_model import model_layers
from vlmshard.train.micro import HostMeta, from_wire, to_wire, wire_inputs
from vlmshard.train.pipeline import recompute_modes, run_layers


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    folder = make_folder(request.param, str(root / "model"))
    shards = make_shards(folder, root, target_samples=3, micro_batches=2)
    return folder, shards


def _pipeline_loss_and_grads(model, batches, recompute: set[str],
                             selective: set[str] = frozenset()):
    """J as ``hf_loss_and_grads`` defines it: a head's second output (a MoE router's aux loss
    × coef, per micro-batch) weighs tokens / micro-batches."""
    funcs = model.build_all()
    flags = recompute_modes(model.names, recompute, selective, model)
    tokens = sum(supervised_tokens(batch) for batch in batches)
    total = 0.0
    for batch in batches:
        micro = model.first_micro(batch)
        loss = run_layers(funcs, model.defs, micro, flags).x
        if loss.dim():
            loss = loss[0] + loss[1:].sum() * tokens / len(batches)
        loss.backward()
        total += float(loss.detach())
    grads = {}
    for layer in funcs:
        for local, p in layer.named_parameters():
            grads[layer.hf_name(local)] = p.grad
    return total, grads


def test_packed_layers_equal_the_hf_model_sample_by_sample(setup):
    """A step of two packed micro-batches through the layers, two of them recomputed whole and
    every other ViT and LLM block selectively (their matmuls' and attention's outputs kept),
    against ``transformers`` on each sample alone: summed loss and every gradient
    (``assert_grad_close``, fp32)."""
    folder, shards = setup
    model = model_layers(folder)
    batches = list(ShardDataset(shards, pixel_dtype=torch.float32))[:2]
    assert sum(b["num_samples"] for b in batches) >= 4 and any(b["num_tiles"] for b in batches)
    whole = {"vit_block_0", "llm_block_1"}
    blocks = {n for n in model.names if n.startswith(("vit_block_", "llm_block_"))} - whole
    loss, grads = _pipeline_loss_and_grads(model, batches, whole, blocks)
    ref_loss, _, ref_grads = hf_loss_and_grads(folder, batches, model.geometry.tokens_per_tile,
                                               model.geometry.pixel_rows_per_tile)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert set(grads) == set(ref_grads)
    floor = grad_floor(ref_grads)
    for name, grad in ref_grads.items():
        assert_grad_close(name, grads[name], grad, floor)


def _padded(batch: dict, extra: int) -> dict:
    """The batch with ``extra`` more padding tokens (and its pixel rows as they were)."""
    out = dict(batch)
    for key, fill in (("input_ids", 0), ("labels", -100)):
        out[key] = torch.cat([batch[key], torch.full((extra,), fill)])
    positions = batch["position_ids"]
    pad = torch.arange(extra).expand(*positions.shape[:-1], extra)
    out["position_ids"] = torch.cat([positions, pad], dim=-1)
    return out


def test_padding_takes_no_compute(setup):
    """The same micro-batch unpadded and with 30% more padding tokens: the same loss, and the
    same FLOPs counted by torch's FlopCounterMode (compute follows the real tokens)."""
    folder, shards = setup
    model = model_layers(folder)
    funcs = model.build_all()
    tight = next(iter(ShardDataset(shards, pixel_dtype=torch.float32, pad_to_caps=False)))
    padded = _padded(tight, int(0.3 * tight["num_tokens"]) + 1)
    results = []
    for batch in (tight, padded):
        micro = model.first_micro(batch)
        with FlopCounterMode(display=False) as counter:
            loss = run_layers(funcs, model.defs, micro, [None] * len(funcs)).x.sum()
            loss.backward()
        results.append((float(loss.detach()), counter.get_total_flops()))
    (loss, flops), (padded_loss, padded_flops) = results
    assert padded["input_ids"].shape[0] >= 1.3 * tight["num_tokens"]
    assert padded_loss == loss
    assert padded_flops == flops > 0


# What reads a device tensor back to the host (a GPU synchronisation): torch's
# ``set_sync_debug_mode`` catches these on CUDA; on CPU they are counted by name.
HOST_READS = {"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "nonzero",
              "argwhere", "masked_select", "unique", "unique_consecutive", "numpy", "cpu"}


class Tracked(torch.Tensor):
    """A tensor that counts host reads of itself and of everything computed from it: the
    stand-in for "on the GPU", so host-side tensors a layer builds itself do not count."""

    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        first = args[0] if args else None
        boolean_index = (name == "__getitem__" and len(args) > 1 and torch.is_tensor(args[1])
                         and args[1].dtype == torch.bool)
        # repeats given as a tensor: the output's size is read back, unless it is given too
        repeats = (kwargs or {}).get("repeats", args[1] if len(args) > 1 else None)
        if isinstance(first, Tracked) and (name in HOST_READS or boolean_index or (
                name == "repeat_interleave" and torch.is_tensor(repeats)
                and not (kwargs or {}).get("output_size"))):
            cls.reads.append(name)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_stage_never_reads_the_device(setup):
    """Every tensor a stage receives is tracked as a device tensor; through each stage's forward
    and backward (the model cut in two, recompute on) nothing is read back to the host: the
    micro-batch's sizes come with it on the host (``HostMeta``)."""
    folder, shards = setup
    model = model_layers(folder)
    funcs = model.build_all()
    cut = model.names.index("embed_tokens") + 2  # a stage boundary inside the LLM
    batch = next(iter(ShardDataset(shards, pixel_dtype=torch.float32)))
    wire = wire_inputs(batch)
    host = HostMeta.of_batch(batch, model.geometry)
    for lo, hi in ((0, cut), (cut, len(funcs))):
        received = tuple(t.as_subclass(Tracked) for t in wire)
        if lo:  # as DeepSpeed hands them over: every float tensor a leaf that takes a gradient
            received = tuple(t.detach().requires_grad_() if t.is_floating_point() else t
                             for t in received)
        Tracked.reads = []
        micro = from_wire(received, host, model.input_phase(lo), model.backend)
        micro = run_layers(funcs[lo:hi], model.defs[lo:hi], micro, ["full"] * (hi - lo))
        outputs = [micro.x, *micro.carry.values()]
        torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
        assert Tracked.reads == [], (model.names[lo], Tracked.reads)
        if hi < len(funcs):
            detached = micro.with_x(micro.x.detach(),
                                    carry={k: t.detach() for k, t in micro.carry.items()})
            wire = to_wire(detached, model.defs[hi - 1].output, model.geometry.tokens_per_tile)


def test_profiling_holds_one_layer_of_each_kind(setup):
    """What ``train profile`` builds: one module per kind (a tied head shares the embedding's),
    standing in for every layer of the kind; far fewer parameters than the model."""
    folder, _ = setup
    model = model_layers(folder)
    shared = model.build_all(one_per_kind=True)
    modules = {id(m): m for m in shared}
    kind, count = Counter(d.kind for d in model.defs
                          if d.name.startswith("llm_block")).most_common(1)[0]
    blocks = [d for d in model.defs if d.kind == kind]
    assert count >= 2 and len({id(shared[model.defs.index(d)]) for d in blocks}) == 1
    assert len(modules) == len({d.tied_key or d.kind for d in model.defs}) < len(model.defs)
    held = sum(p.numel() for m in modules.values() for p in m.parameters())
    assert held < sum(p.numel() for p in model.meta.parameters())


def test_profile_runs_each_layer_on_what_the_previous_made(setup):
    """``train profile``'s layer-by-layer run (one module per kind): every layer runs on the
    previous one's output and what it carries, and all but the head hand bytes on. A DeepStack
    LLM layer receives the carried features besides the hidden states the final norm gets."""
    from vlmshard.train.profile import profile_layers

    folder, shards = setup
    model = model_layers(folder)
    profile = profile_layers(model, list(ShardDataset(shards, pixel_dtype=torch.float32))[:1])
    costs = {c.name: c for c in profile.layers}
    assert list(costs) == model.names and all(c.forward_s > 0 for c in profile.layers)
    assert all(c.output_bytes > 0 for c in profile.layers[:-1])
    if any("deepstack" in d.kind for d in model.defs):
        assert costs["llm_block_0"].input_bytes > costs["final_norm"].input_bytes


def test_a_step_logs_the_spans_the_vit_attends_over(setup):
    """What a step logs of a micro-batch's ViT attention (``train_log.micro_batch_size``) is
    Σ len² over the spans the trainer's own ViT blocks attend within, and each block's FLOPs
    follow the spans it takes: each image on a full block, each window on Qwen2.5-VL's windowed
    ones. A ViT attending within each tile logs none. The default partition's mean sizes (a
    Qwen ViT's read from the images' headers) are the mean of the loader's micro-batches."""
    _assert_logged_vit_sizes_are_the_trainers(*setup)


def test_a_video_logs_each_temporal_step_as_a_span(tmp_path):
    """Qwen2.5-VL (windows, a full block) on images and videos in one step (an MP4, an MKV
    after an image, a frame list): a video's temporal steps are spans of their own, as the
    trainer's ViT attends, and the partition reads the videos' grids as the loader decodes
    them."""
    folder = make_folder("qwen2_5_vl", str(tmp_path / "model"))
    shards = make_shards(folder, tmp_path, rows="mixed", micro_batches=2, algo="random",
                         target_samples=4)
    batches = _assert_logged_vit_sizes_are_the_trainers(folder, shards)
    grids = torch.cat([b["image_grid_thw"][b["media_is_video"]] for b in batches])
    assert (grids[:, 0] > 1).any()  # a video of several temporal steps


def _assert_logged_vit_sizes_are_the_trainers(folder: str, shards: str) -> list[dict]:
    """``test_a_step_logs_the_spans_the_vit_attends_over``'s checks; the loader's batches."""
    from vlmshard.train.default_partition import shard_sizes
    from vlmshard.train.train_log import micro_batch_size

    model = model_layers(folder)
    sizes = model.sizes()
    work = model.analytic_work()
    blocks = [i for i, n in enumerate(model.names) if n.startswith("vit_block_")]
    loaded = list(ShardDataset(shards, pixel_dtype=torch.float32))
    every = [micro_batch_size(b, sizes) for b in loaded]
    mean, _ = shard_sizes(shards, 1, sizes)
    for key in ("tiles", "tokens", "squares", "vit_squares", "vit_windows", "supervised"):
        assert getattr(mean, key) == pytest.approx(np.mean([m.get(key, 0) for m in every]))
    batches = [b for b in loaded if b["num_tiles"]]
    assert batches
    for batch in batches:
        logged = micro_batch_size(batch, sizes)
        # the LM head's rows: the loss's own count of tokens with a target
        assert 0 < logged["supervised"] == supervised_tokens(batch) < logged["tokens"]
        if not sizes.vision.fused_qkv:
            assert "vit_squares" not in logged and "vit_windows" not in logged
            continue
        micro = model.first_micro(batch)
        for i in blocks:
            block = model.build_layer(i)
            meta = block.geometry.meta(micro)
            spans, key, other = ((meta.images, "vit_squares", "vit_windows") if block.full
                                 else (meta.windows, "vit_windows", "vit_squares"))
            assert logged[key] == sum(n * n for n in spans.lengths) > 0
            assert getattr(work[i].flops, key) > 0 == getattr(work[i].flops, other)
    return loaded


def test_analytic_memory_matches_what_a_layer_holds(setup):
    """The memory model (``model_sizes``, what the default partition and recompute plan trust)
    against each layer run in bf16 by the profile: the activations within 15% of the bytes
    autograd saves for backward (its saved-tensor hooks), for every layer kind of every family
    (ViT blocks on pre-merge patches, DeepStack, MoE, linear attention, sliding windows,
    projectors, the head's supervised rows); under selective recompute, what each ViT and
    LLM block keeps beyond its input within 15% of what its forward left alive; the transient
    never below what the layer's forward + backward held beyond its activations (torch's
    memory tracker, parameters and their gradients aside)."""
    folder, shards = setup
    check_memory_model(model_layers(folder), shards, "cpu")


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl"])
def test_analytic_memory_matches_what_cuda_and_liger_kernels_hold(family, tmp_path):
    """The same on a GPU with the kernels a GPU rank runs by default: torch's varlen attention
    (a Qwen ViT's images in one call), Liger's kernels, in the LLM and, Qwen2.5-VL's, in the
    ViT (``model_sizes.Saves``), and the patch embedding as a matmul (``--patch-linear``, on by
    default on CUDA). Until 2026-12-05 this test ran the Conv3d, whose ``vit_embed`` held
    3.5-6 MB above the model on the H200 at these tiny sizes, warm-up or not: likely cuDNN's
    workspace, allocated on each call (at full size, with the matmul, the profile measured
    0.61 of the model's bound)."""
    from vlmshard.train.attention import available_backends
    from vlmshard.train.kernels import Kernels
    from vlmshard.train.models import liger

    if not liger.available() or "varlen" not in available_backends("cuda", torch.bfloat16):
        pytest.skip("needs CUDA, liger-kernel and torch's varlen attention")
    folder = make_folder(family, str(tmp_path / "model"))
    shards = make_shards(folder, tmp_path, target_samples=3, micro_batches=2)
    model = model_layers(folder, "varlen", Kernels(liger=True, patch_linear=True))
    assert model.saves().liger_llm and model.saves().vit_one_call
    check_memory_model(model, shards, "cuda")


def check_memory_model(model, shards: str, device: str) -> None:
    """``test_analytic_memory_matches_what_a_layer_holds``'s checks of ``model`` on the first
    micro-batch of ``shards``, run on ``device`` in bf16."""
    from vlmshard.train.profile import profile_layers

    batches = list(ShardDataset(shards, pixel_dtype=torch.bfloat16))[:1]
    profile = profile_layers(model, batches, device=device, dtype=torch.bfloat16, repeats=1,
                             warmup=0)
    kinds = {}
    for d, cost, analytic, mode in zip(model.defs, profile.layers, profile.analytic,
                                       model.modes):
        kinds.setdefault(d.kind, (cost, analytic, mode))
    assert len(kinds) >= 7
    kept = {kind: f"{a['activation_bytes']} / {c.activation_bytes}"
            for kind, (c, a, _) in kinds.items()
            if abs(a["activation_bytes"] - c.activation_bytes) > 0.15 * c.activation_bytes}
    assert not kept, f"analytic / measured activation bytes: {kept}"
    # selective recompute: what the blocks keep beyond their input, the same way (a frozen
    # prefix has nothing to recompute)
    blocks = {kind: (c.selective_bytes - c.input_bytes, a["selective_bytes"])
              for kind, (c, a, _) in kinds.items() if c.selective_bytes is not None}
    assert {k for k, (_, _, mode) in kinds.items() if k.startswith(("vit_block", "llm_block"))
            and "linear" not in k and mode != "forward"} == set(blocks)
    selective = {kind: f"{analytic / measured:.2f}" for kind, (measured, analytic)
                 in blocks.items() if abs(analytic - measured) > 0.15 * measured}
    assert not selective, f"analytic / measured selective bytes: {selective}"
    under = {kind: f"{a['transient_bytes']} < {c.transient_bytes}"
             for kind, (c, a, _) in kinds.items() if a["transient_bytes"] < c.transient_bytes}
    assert not under, f"analytic transient bytes below the measured: {under}"


@pytest.mark.parametrize("family", ["internvl", "internvl_final_norm", "qwen2_vl", "qwen3_vl"])
def test_profiled_analytic_bytes_are_counted_in_the_dtype_measured(family, tmp_path):
    """``vlmshard train profile``'s analytic activation bytes, beside the measured, are counted
    in the dtype the profile runs in: fp32 (a CPU run's default) and bf16, every layer within
    15% of the bytes torch's saved-tensor hooks count for its backward (at bf16's width in an
    fp32 run they were 0.50-0.59 of them); InternVL's projector layer with InternViT's final
    LayerNorm (``use_mean_pooling`` false) counts the norm (without it, 0.72 in bf16)."""
    from vlmshard.train.profile import profile_layers

    folder = make_folder(family, str(tmp_path / "model"))
    shards = make_shards(folder, tmp_path, target_samples=3, micro_batches=2)
    model = model_layers(folder)
    for dtype in (torch.float32, torch.bfloat16):
        batches = list(ShardDataset(shards, pixel_dtype=dtype))[:1]
        profile = profile_layers(model, batches, dtype=dtype, repeats=1, warmup=0)
        off = {name: f"{a['activation_bytes'] / c.activation_bytes:.2f}"
               for name, c, a in zip(model.names, profile.layers, profile.analytic)
               if abs(a["activation_bytes"] - c.activation_bytes) > 0.15 * c.activation_bytes}
        assert not off, f"{dtype}: analytic / measured activation bytes: {off}"


ATTENTION_CASES = [(device, dtype, backend)
                   for device, dtype in (("cpu", torch.float32), ("cuda", torch.bfloat16))
                   for backend in ("sdpa", "varlen", "flash")]


@pytest.mark.parametrize("device, dtype, backend", ATTENTION_CASES)
def test_packed_attention_equals_each_sample_alone(device, dtype, backend):
    """Each backend's packed attention over segments against torch's SDPA run on each segment
    by hand, outputs and gradients: causal (the LLM, grouped-query heads) and full; three
    segments of one length in a row (SDPA takes them as one batch). Each runs where it can
    (varlen and flash: CUDA in bf16; on this CPU, SDPA)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from vlmshard.train.attention import available_backends, implementation

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device here")
    if backend not in available_backends(device, dtype):
        pytest.skip(f"{backend} does not run on {device} in {dtype} (or is not installed)")
    torch.manual_seed(0)
    lengths = [5, 1, 4, 4, 4, 9, 3]
    n = sum(lengths)

    class Module(torch.nn.Module):
        is_causal = True
        num_key_value_groups = 2

    attend = ALL_ATTENTION_FUNCTIONS[implementation(backend)]
    for causal in (True, False):
        q = torch.randn(1, 4, n, 8, device=device, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(1, 2, n, 8, device=device, dtype=dtype, requires_grad=True)
                for _ in range(2))
        spans = Spans.from_lengths(lengths, backend, torch.device(device))
        out, _ = attend(Module(), q, k, v, None, is_causal=None if causal else False,
                        **spans.kwargs())
        weights = torch.randn_like(out)
        grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
        expected, start = [], 0
        for length in lengths:
            part = slice(start, start + length)
            expected.append(torch.nn.functional.scaled_dot_product_attention(
                q[:, :, part], k[:, :, part].repeat_interleave(2, 1),
                v[:, :, part].repeat_interleave(2, 1), is_causal=causal).transpose(1, 2))
            start += length
        expected = torch.cat(expected, dim=1)
        reference = torch.autograd.grad((expected * weights).sum(), (q, k, v))
        tolerance = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
        torch.testing.assert_close(out, expected, **tolerance)
        for got, want in zip(grads, reference):
            torch.testing.assert_close(got, want, **tolerance)


def test_sdpa_takes_consecutive_unmasked_segments_of_one_length_in_one_call():
    from vlmshard.train.attention import sdpa_batches

    lengths = [4, 4, 4, 2, 4, 4, 4, 3, 3]
    masked = [False, False, False, False, True, False, False, False, True]
    assert sdpa_batches(lengths, masked) == [(0, 3), (3, 4), (4, 5), (5, 7), (7, 8), (8, 9)]
    assert sdpa_batches([], []) == []


@pytest.mark.parametrize("device, dtype, backend",
                         [c for c in ATTENTION_CASES if supports_runs(c[2])])
def test_windowed_and_bidirectional_attention_equal_a_hand_mask(device, dtype, backend):
    """Gemma 3's patterns within packed samples: image runs attended both ways, a sliding
    window of 3 (on and off), against SDPA on each sample with a mask written out by hand from
    transformers' definitions (causal or same run, and key > query - window). The last two
    samples are of one length, a run in the first of them only."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from vlmshard.train.attention import available_backends, implementation

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device here")
    if backend not in available_backends(device, dtype):
        pytest.skip(f"{backend} does not run on {device} in {dtype} (or is not installed)")
    torch.manual_seed(0)
    lengths = [5, 1, 9, 3, 3]
    runs = [(0, 2), (7, 11), (12, 14), (15, 17)]  # sequence positions
    n = sum(lengths)

    class Module(torch.nn.Module):
        is_causal = True
        num_key_value_groups = 2

    attend = ALL_ATTENTION_FUNCTIONS[implementation(backend)]
    for window, with_runs in ((None, True), (3, False), (3, True)):
        q = torch.randn(1, 4, n, 8, device=device, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(1, 2, n, 8, device=device, dtype=dtype, requires_grad=True)
                for _ in range(2))
        spans = Spans.from_lengths(lengths, backend, torch.device(device),
                                   runs if with_runs else None)
        out, _ = attend(Module(), q, k, v, None, sliding_window=window, **spans.kwargs())
        expected, start = [], 0
        for length in lengths:
            mask = torch.zeros(length, length, dtype=torch.bool, device=device)
            for i in range(length):
                for j in range(length):
                    same_run = with_runs and any(a <= start + i < b and a <= start + j < b
                                                 for a, b in runs)
                    mask[i, j] = (j <= i or same_run) and (window is None or j > i - window)
            part = slice(start, start + length)
            expected.append(torch.nn.functional.scaled_dot_product_attention(
                q[:, :, part], k[:, :, part].repeat_interleave(2, 1),
                v[:, :, part].repeat_interleave(2, 1), attn_mask=mask).transpose(1, 2))
            start += length
        tolerance = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
        torch.testing.assert_close(out, torch.cat(expected, dim=1), **tolerance)


def test_targets_never_cross_samples():
    labels = torch.tensor([1, 2, 3, 4, 5, 6])
    targets = next_token_targets(labels, torch.tensor([0, 3, 6], dtype=torch.int32))
    assert targets.tolist() == [2, 3, -100, 5, 6, -100]


def test_rotary_tables_move_to_the_device_of_their_input():
    """A ``Detached`` rotary module's buffers follow its input's device at the first call (on
    CUDA an inverse-frequency table left on the host is copied at every call, and the host
    waits: 8 syncs a step on an H200); the meta device stands in for another device here."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    from vlmshard.train.models.layers import Detached

    rotary = Detached(Qwen2RotaryEmbedding(Qwen2Config(hidden_size=32, num_attention_heads=4)))
    want = rotary(torch.zeros(1, 5, 32), torch.arange(5)[None])
    assert rotary.module.inv_freq.device.type == "cpu"
    cos, sin = rotary(torch.zeros(1, 5, 32, device="meta"), torch.arange(5, device="meta")[None])
    assert rotary.module.inv_freq.device.type == "meta" and cos.device.type == "meta"
    assert cos.shape == want[0].shape and sin.shape == want[1].shape


@pytest.mark.parametrize("family", FAMILIES)
def test_zero3_weights_are_the_hf_models(family, tmp_path):
    """The weights ZeRO-3 splits, counted from the layer map, are the ``transformers`` model's
    own: all its parameters (a tied head's once), those at most a threshold, and the most one
    module holds itself."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    folder = make_folder(family, str(tmp_path / "model"))
    with torch.device("meta"):
        hf = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(folder))
    sizes = [p.numel() for p in hf.parameters()]  # each once, a tied one too
    threshold = sorted(sizes)[len(sizes) // 2]
    got = model_layers(folder).zero3_weights(threshold)
    assert (got.total, got.persistent, got.largest_module) == (
        sum(sizes), sum(n for n in sizes if n <= threshold),
        max(sum(p.numel() for p in m.parameters(recurse=False)) for m in hf.modules()))
