"""The optional kernels (``vlmshard.train.kernels``) against the plain path.

- ``vit_varlen``: a Qwen ViT block over a micro-batch of images of different sizes (and, in
  Qwen2.5-VL, windows) equals the ``transformers`` block run on each image or window alone:
  output and gradients, fp32. On CPU the SDPA backend, and torch's varlen backend with a
  reference kernel standing in for the CUDA one (2.13's signature, one SDPA call over the whole
  micro-batch with a block-diagonal mask), which must be called once per block; on CUDA, the
  real kernel in bf16.
- ``patch_linear``: the ViT's patch embedding as a matmul is as close to the float64 Conv3d
  as the fp32 Conv3d is.
- ``compile_blocks``: compiled ViT blocks and decoder layers on micro-batches of different
  packed lengths compile each frame once (counted by a hook of the test's own) and equal
  eager. ``aot_eager`` stands in for inductor: on a shared 2-core CPU, inductor's C++ compile
  of one decoder layer had not finished its first micro-batch after 300 s; the guards (what
  recompiles) are dynamo's, the same for every backend.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
from hf_reference import make_folder

from vlmshard.train.hf_model import model_layers
from vlmshard.train.kernels import COMPILES, Kernels, compiles_inside
from vlmshard.train.micro import HostMeta, LayerOutput, Micro, Phase

QWEN_VITS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# (t, h, w) patches: images of three sizes, and a video of two frames (each its own segment) the
# size of the image before it; Qwen2.5-VL's 8-patch windows cut the first and last into windows
# of 4 sizes
GRIDS = [(1, 12, 10), (1, 4, 6), (2, 4, 6), (1, 2, 18)]

calls: list[torch.Tensor] = []


def varlen_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                     scale=None, window_size=(-1, -1), enable_gqa=False, seqused_k=None,
                     block_table=None, num_splits=None):
    """torch 2.13's ``varlen_attn`` on CPU: each segment of ``cu_seq_q`` attends within itself
    (causal where ``window_size`` is (-1, 0)), in one SDPA call with a block-diagonal mask."""
    calls.append(cu_seq_q)
    segment = torch.repeat_interleave(torch.arange(len(cu_seq_q) - 1), cu_seq_q.diff().long())
    mask = segment[:, None] == segment[None, :]
    if window_size == (-1, 0):
        mask &= torch.ones_like(mask).tril()
    out = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(0, 1) for t in (query, key, value)), attn_mask=mask, scale=scale,
        enable_gqa=enable_gqa)
    return out.transpose(0, 1)


@pytest.fixture(scope="module", params=QWEN_VITS)
def folder(request, tmp_path_factory):
    return make_folder(request.param, str(tmp_path_factory.mktemp(request.param) / "model"))


def _micro(x: torch.Tensor, backend: str, grids=(), lengths=(), rows: int = 3) -> Micro:
    """A micro-batch holding ``x``: ViT rows of images ``grids``, or the tokens of samples
    ``lengths`` (each at positions 0..len-1, in ``rows`` rows: mRoPE's three alike, or one)."""
    n = sum(lengths)
    host = HostMeta(qv=len(x), qt=n, tiles=len(x), tokens=n, image_tokens=0, supervised=0,
                    grids=list(grids), sample_lengths=list(lengths), image_runs=[])
    positions = torch.cat([torch.arange(k) for k in lengths]) if lengths else \
        torch.zeros(0, dtype=torch.long)
    positions = positions.to(x.device)
    return Micro(x=x, input_ids=torch.zeros(n, dtype=torch.long, device=x.device),
                 position_ids=positions.expand(3, n) if rows == 3 else positions,
                 labels=torch.zeros(n, dtype=torch.long, device=x.device),
                 host=host, backend=backend, phase=Phase("rows", 1), wire=())


def _vision_blocks(model) -> list[int]:
    """The first ViT block of each kind but DeepStack's (its block is a plain one)."""
    kinds = {}
    for i, d in enumerate(model.defs):
        if d.name.startswith("vit_block_") and d.variant != "deepstack":
            kinds.setdefault(d.kind, i)
    return list(kinds.values())


def _segments_alone(block, x, rope, lengths):
    """``transformers``' block on each segment alone (its own SDPA, one segment)."""
    outs = [block(part, cu_seqlens=torch.tensor([0, len(part)], dtype=torch.int32),
                  position_embeddings=(cos, sin))
            for part, cos, sin in zip(x.split(lengths), *(t.split(lengths) for t in rope))]
    return torch.cat(outs)


@pytest.mark.parametrize("backend, device, vit_varlen, cudnn", [
    ("sdpa", "cpu", True, False), ("sdpa", "cpu", False, False), ("varlen", "cpu", True, False),
    ("varlen", "cpu", True, True), ("varlen", "cuda", True, False), ("varlen", "cuda", True, True)])
def test_vit_block_over_all_images_equals_each_image_alone(folder, monkeypatch, backend, device,
                                                           vit_varlen, cudnn):
    """The varlen backend makes one kernel call a block; with ``sdpa_cudnn`` none (the images
    on SDPA, consecutive ones of one size in one call), and on CUDA cuDNN's kernels ran (the
    profiler's kernel names)."""
    import torch.nn.attention.varlen
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    if cuda and not torch.cuda.is_available():
        pytest.skip("no CUDA device here")
    if not cuda and backend == "varlen":
        monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", varlen_reference)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = model_layers(folder, backend, Kernels(vit_varlen=vit_varlen, sdpa_cudnn=cudnn))
    plain = model_layers(folder, "sdpa", Kernels(vit_varlen=False))
    hidden = model.meta.config.vision_config.hidden_size
    patches = sum(t * h * w for t, h, w in GRIDS)
    for index in _vision_blocks(model):
        layer = model.build_layer(index, device, dtype)
        reference = plain.build_layer(index, device, dtype)
        torch.manual_seed(index)
        x = torch.randn(patches, hidden, device=device, dtype=dtype, requires_grad=True)
        micro = _micro(x, backend, GRIDS)
        calls.clear()
        with profile(activities=[ProfilerActivity.CUDA]) if cudnn and cuda else \
                contextlib.nullcontext() as prof, \
                _calls_of(torch.nn.functional, "scaled_dot_product_attention") as sdpa:
            out = layer(micro)
        assert len(calls) == (backend == "varlen" and not cuda and not cudnn)
        if cudnn and cuda:
            assert any("cudnn" in e.name.lower() for e in prof.events()), \
                sorted({e.name for e in prof.events()})[:20]
        meta = layer.geometry.meta(micro)
        spans = meta.images if layer.full else meta.windows
        if index == _vision_blocks(model)[0]:  # the images, or Qwen2.5's windows, differ
            assert len(set(spans.lengths)) > 2, spans.lengths
        if backend == "sdpa" or cudnn:  # (the CPU's reference varlen kernel calls SDPA)
            # one SDPA call a run of equal lengths (the video's frames and the image before
            # them) where the block hands all images over at once, else one an image
            runs = len([k for k, _ in itertools.groupby(spans.lengths)])
            assert len(sdpa) == (runs if vit_varlen else len(spans.lengths)), \
                [s[2] for s in sdpa]
        want = _segments_alone(reference.block, x, meta.rope, spans.lengths)
        weights = torch.randn_like(out)
        got_grads = torch.autograd.grad((out * weights).sum(), [x, *layer.parameters()])
        want_grads = torch.autograd.grad((want * weights).sum(), [x, *reference.parameters()])
        if dtype == torch.bfloat16:
            _within_bf16_error(layer, plain.build_layer(index, device, torch.float32), x,
                               backend, spans.lengths, weights, [out, *got_grads],
                               [want, *want_grads])
            continue
        # fp32 sums in other orders: the reference varlen kernel's over a whole micro-batch's
        # masked rows, a batch of equal segments', the projections' over all rows (oneDNN
        # blocks a GEMM by its row count); attending across images would be off by the scale
        tolerance = {"rtol": 1e-4, "atol": 1e-4}
        torch.testing.assert_close(out, want, **tolerance)
        for got, expected in zip(got_grads, want_grads):
            torch.testing.assert_close(got, expected, **tolerance)


@contextlib.contextmanager
def _calls_of(owner, name: str):
    """The first argument's shape of each call of ``owner.name`` in the block."""
    seen, real = [], getattr(owner, name)

    def counted(*args, **kwargs):
        seen.append(args[0].shape)
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(owner, name, counted)
        yield seen


def _within_bf16_error(layer, exact_layer, x, backend, lengths, weights, got, plain):
    """bf16: the output and gradients ``got`` are as close to the fp32 computation (``exact_layer``
    on each segment alone) as the plain bf16 path's (``plain``) are: within twice its error, as
    flash-attn's own tests judge its kernels, and a hundredth of the tensor's largest value (a
    norm's gradient sums every row; rows attending across images would be off by the whole
    scale). Two bf16 paths compared with each other differ by more than any fixed tolerance
    where a gradient is a sum over rows that nearly cancel: an H200 saw 7% on one bias."""
    x32 = x.detach().float().requires_grad_()
    rope = layer.geometry.meta(_micro(x32, backend, GRIDS)).rope
    exact = _segments_alone(exact_layer.block, x32, rope, lengths)
    exact = [exact, *torch.autograd.grad((exact * weights.float()).sum(),
                                         [x32, *exact_layer.parameters()])]
    for name, g, p, e in zip(["output", "input", *(n for n, _ in layer.named_parameters())],
                             got, plain, exact):
        error, plain_error = ((t.float() - e).abs().max().item() for t in (g, p))
        assert error <= 2 * plain_error + 1e-2 * e.abs().max().item(), (name, error, plain_error)


def test_compiled_blocks_compile_once_whatever_the_lengths_and_equal_eager(tmp_path):
    """Two ViT blocks (windows, then whole images) and two decoder layers compiled, on three
    micro-batches of different packed lengths and segment counts (the first with as many
    boundaries as a dimension of another input has): each frame compiles once for
    the ViT and once for the LLM (a second layer reuses the first's graphs; a new length none
    of them: the attention is an op of the graph),
    and outputs and input gradients equal eager's."""
    from torch._dynamo.callback import CallbackTrigger, callback_handler

    folder = make_folder("qwen2_5_vl", str(tmp_path / "model"))
    eager = model_layers(folder, "sdpa", Kernels())
    compiled = model_layers(folder, "sdpa", Kernels(compile_blocks=("vit", "llm"),
                                                    compile_backend="aot_eager"))
    torch._dynamo.reset()
    started: list[str] = []

    def record(args):
        if args.callback_trigger == CallbackTrigger.DYNAMO:
            started.append(args.compile_id)

    callback_handler.register_start_callback(record)
    counted = COMPILES.total
    per_kind = []
    try:
        for names, hidden, inputs in (
                (("vit_block_0", "vit_block_1"), compiled.meta.config.vision_config.hidden_size,
                 # first 15 images of one window each: 16 boundaries, as many as the rotary
                 # table's width, which duck sizing would tie together
                 [[(1, 2, 2)] * 15, [(1, 12, 10), (1, 4, 6)], [(1, 2, 18)],
                  [(1, 8, 8), (1, 6, 4), (1, 4, 4)]]),
                (("llm_block_0", "llm_block_1"), compiled.meta.config.text_config.hidden_size,
                 [[5, 7, 3], [9, 2], [4, 4, 4, 6]])):
            before = len(started)
            for name in names:
                index = compiled.names.index(name)
                layer, reference = compiled.build_layer(index), eager.build_layer(index)
                for shape in inputs:
                    vision = name.startswith("vit")
                    grids, lengths = (shape, ()) if vision else ((), shape)
                    rows = sum(t * h * w for t, h, w in grids) or sum(lengths)
                    x = torch.randn(rows, hidden, requires_grad=True)
                    out = layer(_micro(x, "sdpa", grids, lengths))
                    want = reference(_micro(x, "sdpa", grids, lengths))
                    torch.testing.assert_close(out, want)
                    torch.testing.assert_close(torch.autograd.grad(out.sum(), x)[0],
                                               torch.autograd.grad(want.sum(), x)[0])
            per_kind.append(started[before:])
    finally:
        callback_handler.remove_start_callback(record)
    for ids in per_kind:
        assert ids, "nothing was compiled"
        frames = [compile_id.split("/")[0] for compile_id in ids]
        assert len(set(frames)) == len(frames), ids
    assert COMPILES.total - counted == len(started)


def test_sdpa_cudnn_puts_cudnn_first_while_a_layer_runs(tmp_path):
    """With ``sdpa_cudnn`` a layer runs with SDPA's priority cuDNN, flash, memory-efficient,
    math (read inside its ``transformers`` block), and the order before it after; the output
    is the plain layer's (on CPU SDPA has no cuDNN kernel: the same arithmetic)."""
    from torch.nn.attention import SDPBackend

    folder = make_folder("qwen3_vl", str(tmp_path / "model"))
    before = torch._C._get_sdp_priority_order()
    seen = []
    outs = []
    x = None
    for cudnn in (True, False):
        model = model_layers(folder, "sdpa", Kernels(sdpa_cudnn=cudnn))
        layer = model.build_layer(model.names.index("vit_block_1"))
        layer.block.register_forward_hook(
            lambda *_: seen.append(torch._C._get_sdp_priority_order()))
        if x is None:
            x = torch.randn(sum(t * h * w for t, h, w in GRIDS),
                            model.meta.config.vision_config.hidden_size)
        outs.append(layer(_micro(x, "sdpa", GRIDS)))
        assert torch._C._get_sdp_priority_order() == before
    assert seen[0][:4] == [int(b) for b in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                            SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)]
    assert seen[1] == before
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_compiled_blocks_take_inductors_fusion_and_the_other_layers_ligers(tmp_path,
                                                                        monkeypatch):
    """With ``compile_blocks`` and ``liger``, the parts named are compiled and Liger's kernels
    go to the layers not compiled (the final norm; the decoder layers where only the ViT is
    compiled), none into a compiled block: with Liger's autograd functions inside a compiled
    decoder layer, Dynamo stopped on an H200 (torch 2.11). Liger itself runs on CUDA only, so
    which layers it is given is recorded here; without ``compile_blocks`` every layer is given
    it."""
    from vlmshard.train.models import liger

    folder = make_folder("qwen3_vl", str(tmp_path / "model"))
    fused: list[str] = []
    monkeypatch.setattr(liger, "fuse", lambda layer, repeated: fused.append(type(layer).__name__))
    names = ("vit_block_0", "llm_block_0", "final_norm")
    for compile_blocks, want in ((("vit", "llm"), ["FinalNorm"]),
                                 (("vit",), ["Qwen3DecoderLayer", "FinalNorm"]),
                                 ((), ["DeepStackBlock", "Qwen3DecoderLayer", "FinalNorm"])):
        model = model_layers(folder, "sdpa", Kernels(liger=True, compile_blocks=compile_blocks,
                                                     compile_backend="aot_eager"))
        fused.clear()
        layers = [model.build_layer(model.names.index(name)) for name in names]
        assert fused == want, (compile_blocks, fused)
        assert [compiles_inside(layer) for layer in layers[:2]] == [
            "vit" in compile_blocks, "llm" in compile_blocks]


def test_recompiles_over_the_bound_are_a_warning(caplog):
    """A function compiled for float, then int inputs: two compilations of one frame (counted
    by hand), each logged; over a bound of 0 recompiles, one warning."""
    import logging

    from torch._dynamo.callback import callback_handler

    from vlmshard.train.kernels import CompileCount

    torch._dynamo.reset()
    count = CompileCount()
    count.watch(0)
    try:
        with caplog.at_level(logging.INFO, logger="vlmshard.train.kernels"):
            double = torch.compile(lambda x: x * 2, backend="eager")
            for dtype in (torch.float32, torch.int64):
                double(torch.ones(3, dtype=dtype))
    finally:
        callback_handler.remove_start_callback(count._started)
    assert count.total == 2
    lines = [r.getMessage() for r in caplog.records]
    assert sum("compilation" in line for line in lines) == 2
    assert [r.levelname for r in caplog.records].count("WARNING") == 1


# Liger patches these families' LLM norms, gated MLPs and rotary embeddings (Qwen2.5-VL's ViT
# norms and gated MLP too, Qwen3-VL's ViT rotary); the first uses mRoPE's three position rows
LIGER_FAMILIES = {"qwen2_5_vl": 3, "qwen3_vl": 3, "gemma3": 1, "qwen3_5": 3, "internvl": 1}


@pytest.mark.parametrize("family", LIGER_FAMILIES)
def test_liger_layers_are_as_close_to_fp32_as_the_plain_path(family, tmp_path):
    """Each layer kind Liger changes (``vlmshard.train.models.liger``), in bf16 on CUDA: its
    output and every gradient within twice the plain bf16 layer's error of the fp32 layer (plus
    1% of scale), on three packed samples (LLM) or images (ViT); the fused layer holds Liger's norm
    and its rotary hook, the plain one none; recomputed selectively (the matmuls' outputs kept,
    Liger's kernels run again), its gradients are the same (no kernel wrote over a kept
    tensor: Liger's rotary kernel writes q and k in place)."""
    from vlmshard.train.attention import choose_backend
    from vlmshard.train.models import liger
    from vlmshard.train.recompute import run_layer

    if not liger.available():
        pytest.skip("Liger's kernels need CUDA and liger-kernel")
    folder = make_folder(family, str(tmp_path / "model"))
    backend = choose_backend("cuda", torch.bfloat16)
    fused = model_layers(folder, backend, Kernels(liger=True))
    plain = model_layers(folder, backend, Kernels())
    fp32 = model_layers(folder, "sdpa", Kernels(vit_varlen=False))  # the varlen kernel: bf16
    checked = []
    for index, d in enumerate(fused.defs):
        vision = d.name.startswith("vit_block")
        if d.kind in checked or not (vision or d.name.startswith("llm_block")
                                     or d.name == "final_norm"):
            continue
        if vision and family not in QWEN_VITS or "deepstack" in d.variant:
            continue  # (a DeepStack layer is a plain one with the carried features added)
        layer = fused.build_layer(index, "cuda", torch.bfloat16)
        if not any(type(m).__name__ == "LigerRMSNorm" for m in layer.modules()) and not any(
                m._forward_pre_hooks for m in layer.modules()):
            continue  # nothing of Liger's in this kind (Qwen3-VL's ViT blocks have rotary only)
        checked.append(d.kind)
        reference = plain.build_layer(index, "cuda", torch.bfloat16)
        exact = fp32.build_layer(index, "cuda", torch.float32)
        assert not any("Liger" in type(m).__name__ for m in reference.modules())
        config = fused.meta.config
        hidden = (config.vision_config if vision else getattr(config, "text_config", config)
                  ).hidden_size
        torch.manual_seed(index)
        grids, lengths = (GRIDS, ()) if vision else ((), (37, 5, 22))
        rows = sum(t * h * w for t, h, w in grids) or sum(lengths)
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        results = []
        for module, dtype, mode, kernel in ((layer, torch.bfloat16, None, backend),
                                            (reference, torch.bfloat16, None, backend),
                                            (exact, torch.float32, None, "sdpa"),
                                            (layer, torch.bfloat16, "selective", backend)):
            xi = x.to(dtype).requires_grad_()
            micro = _micro(xi, kernel, grids, lengths, LIGER_FAMILIES[family])
            out = run_layer(module, micro, mode)
            out = out.x if isinstance(out, LayerOutput) else out
            seeded = torch.Generator("cuda").manual_seed(1)
            weights = torch.ones_like(out).normal_(generator=seeded)
            grads = torch.autograd.grad((out.float() * weights.float()).sum(),
                                        [xi, *module.parameters()])
            results.append([out, *grads])
        names = ["output", "input", *(n for n, _ in layer.named_parameters())]
        for name, got, recomputed in zip(names, results[0], results[3]):
            # (flash attention's backward sums dq atomically: not bitwise, but a kernel applied
            # to its own output again would be off by the whole scale)
            torch.testing.assert_close(recomputed.float(), got.float(), rtol=0,
                                       atol=1e-2 * got.abs().max().item(), msg=(d.kind, name))
        for name, got, plain_bf16, want in zip(names, *results[:3]):
            error, plain_error = ((t.float() - want).abs().max().item() for t in (got, plain_bf16))
            assert error <= 2 * plain_error + 1e-2 * want.abs().max().item(), \
                (d.kind, name, error, plain_error)
    assert checked, "Liger changed no layer"


def test_liger_asked_for_where_it_cannot_run_is_refused_and_off_by_default():
    """``--liger`` where CUDA or liger-kernel is missing: a config error naming the option; left
    unset, it is on exactly where it runs."""
    from vlmshard.config import ConfigError
    from vlmshard.train.config import TrainConfig
    from vlmshard.train.models import liger

    cuda = torch.cuda.is_available()
    unset = TrainConfig(shards="s", out="o")
    unset.resolve_device_defaults(cuda)
    assert unset.liger is liger.available()
    if liger.available():
        return
    asked = TrainConfig(shards="s", out="o", liger=True)
    with pytest.raises(ConfigError, match="--liger"):
        asked.resolve_device_defaults(cuda)


def test_an_attention_backend_asked_for_where_it_cannot_run_is_refused():
    """``--attention``: a backend the device cannot run in the run's precision is a config
    error naming what runs there, before any rank starts; one that runs is taken as asked."""
    from typing import get_args

    from vlmshard.config import ConfigError
    from vlmshard.train.attention import IMPLEMENTATIONS, choose_backend
    from vlmshard.train.config import Attention, TrainConfig

    assert set(get_args(Attention)) == {"auto", *IMPLEMENTATIONS}  # the option names them all
    asked = TrainConfig(shards="s", out="o", attention="varlen")
    with pytest.raises(ConfigError, match="attention: varlen does not run on cpu in float32; "
                                          "here: sdpa"):
        asked.resolve_device_defaults(cuda=False)
    TrainConfig(shards="s", out="o", attention="sdpa").resolve_device_defaults(cuda=False)
    assert choose_backend("cpu", torch.float32, "sdpa") == "sdpa"
    assert choose_backend("cpu", torch.float32) == "sdpa"
    with pytest.raises(ValueError, match="unknown attention backend 'xformers'"):
        choose_backend("cpu", torch.float32, "xformers")


@pytest.mark.parametrize("family", ("qwen2_vl", "qwen3_vl"))
def test_patch_embedding_as_a_matmul_is_as_close_to_float64_as_the_conv(family, tmp_path):
    """``patch_linear``: the ViT's patch embedding run as a matmul on the Conv3d's weight is the
    same arithmetic in another order: its output and every gradient as close to the Conv3d
    layer's in float64 as the fp32 Conv3d layer's are (twice its error, plus 1e-6 of scale), on
    the pixel rows of three images. Qwen3-VL's layer also adds its resampled position table.
    (Qwen2.5-VL and Qwen3.5 hold their families' same module.) A patch row in the wrong order
    would be off by the whole scale."""
    folder = make_folder(family, str(tmp_path / "model"))
    matmul = model_layers(folder, "sdpa", Kernels(patch_linear=True)).build_layer(0)
    conv = model_layers(folder, "sdpa", Kernels())
    assert matmul.linear and not conv.build_layer(0).linear
    rows = sum(t * h * w for t, h, w in GRIDS)
    width = conv.meta.config.vision_config
    pixels = torch.randn(rows, width.in_channels * width.temporal_patch_size
                         * width.patch_size ** 2, generator=torch.Generator().manual_seed(0))
    results = []
    for layer, dtype in ((matmul, torch.float32), (conv.build_layer(0), torch.float32),
                         (conv.build_layer(0, dtype=torch.float64), torch.float64)):
        out = layer(_micro(pixels.to(dtype), "sdpa", GRIDS))
        weights = torch.ones_like(out).normal_(generator=torch.Generator().manual_seed(1))
        results.append([out, *torch.autograd.grad((out * weights).sum(),
                                                  list(layer.parameters()))])
    names = ["output", *(n for n, _ in matmul.named_parameters())]
    for name, got, plain, want in zip(names, *results):
        error, plain_error = ((t.double() - want).abs().max().item() for t in (got, plain))
        assert error <= 2 * plain_error + 1e-6 * want.abs().max().item(), \
            (name, error, plain_error)
