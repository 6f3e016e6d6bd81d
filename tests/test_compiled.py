"""Compiled blocks that hold (``--compile-blocks``, ``vlmshard.train.kernels.compile_block``).

A ViT block and a decoder layer of a tiny Qwen2.5-VL, compiled and recomputed selectively, on
20 micro-batches each of different packed lengths and image counts:

- one graph a block (``fullgraph``), the packed attention inside it as an op
  (``vlmshard::packed_attention``), no graph break (dynamo's own counter);
- compiled once per block kind, on the first micro-batch, never again (dynamo's callback, by
  a hook of the test's own);
- the fp32 loss and every gradient within 1e-5 (relative to the tensor's largest value) of the
  ``transformers`` block run eagerly under eager selective recompute;
- the recompute inside the compiled graph (torchtitan's order, ``compile(checkpoint(block))``):
  the graph dynamo captured holds the checkpoint's higher-order op.

An ``autograd.Function`` norm (a pure-torch stand-in for Liger's ``LigerRMSNormFunction``, on
which a run stopped in Dynamo, torch 2.11 on an H200) inside a selectively recomputed compiled
decoder layer traces into the one graph and equals eager; where Liger is asked for, a compiled
block takes none of its modules.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from hf_reference import make_folder
from test_kernels import _micro
from torch import nn

from vlmshard.train.hf_model import model_layers
from vlmshard.train.kernels import Kernels, compiles_inside
from vlmshard.train.pipeline import run_layers

MICRO_BATCHES = 20


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_folder("qwen2_5_vl", str(tmp_path_factory.mktemp("qwen2_5_vl") / "model"))


def _shapes(vision: bool, rng: random.Random) -> list:
    """Micro-batches: 1-5 images of (t, h, w) patches (a two-frame video among them now and
    then; Qwen's 2×2 merge wants even sides), or 1-5 samples of 2-40 tokens."""
    if vision:
        return [[(rng.choice((1, 1, 2)), 2 * rng.randint(1, 6), 2 * rng.randint(1, 6))
                 for _ in range(rng.randint(1, 5))] for _ in range(MICRO_BATCHES)]
    return [[rng.randint(2, 40) for _ in range(rng.randint(1, 5))]
            for _ in range(MICRO_BATCHES)]


class _Compilations:
    """Dynamo's compilations while the block runs (its start callback) and the graphs it
    captured, as op names (a backend of the test's own in front of ``aot_eager`` or
    ``inductor``)."""

    def __init__(self, backend: str) -> None:
        self.ids: list[str] = []
        self.graphs: list[tuple[set[str], set[str]]] = []  # (top-level ops, all ops) a graph
        self.inner = torch._dynamo.lookup_backend(backend)

    def backend(self, gm, inputs):
        # read now: the backend takes the graph's nodes away
        self.graphs.append(({str(node.target) for node in gm.graph.nodes}, _targets(gm)))
        return self.inner(gm, inputs)

    def started(self, args) -> None:
        from torch._dynamo.callback import CallbackTrigger

        if args.callback_trigger == CallbackTrigger.DYNAMO:
            self.ids.append(args.compile_id)

    def __enter__(self):
        from torch._dynamo.callback import callback_handler

        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        callback_handler.register_start_callback(self.started)
        return self

    def __exit__(self, *_):
        from torch._dynamo.callback import callback_handler

        callback_handler.remove_start_callback(self.started)


def _loss_and_grads(layer, d, x, micro, weights, mode: str = "selective"
                    ) -> list[torch.Tensor]:
    """The layer as a pipeline stage runs it (``run_layers``), recomputed as ``mode`` says."""
    x = x.detach().requires_grad_()
    out = run_layers([layer], [d], micro(x), [mode]).x
    loss = (out * weights).square().mean()  # positive terms: no sum that cancels
    return [loss, *torch.autograd.grad(loss, [x, *layer.parameters()])]


def _assert_within(got: list[torch.Tensor], want: list[torch.Tensor], what) -> None:
    for name, g, w in zip(["loss", "input", "parameters..."], got, want):
        error = ((g - w).abs().max() / w.abs().max()).item()
        assert error <= 1e-5, (what, name, error)


def _check_blocks(folder, backend: str, names: tuple[str, ...], swap=None,
                  mode: str = "selective", attention: str = "sdpa") -> _Compilations:
    """Each layer of ``names`` compiled (with ``backend``) against eager, on its part's 20
    micro-batches, recomputed as ``mode`` says, attending with ``attention``; ``swap(layer)``
    changes both before they run."""
    eager_model = model_layers(folder, attention, Kernels())
    rng = random.Random(0)
    with _Compilations(backend) as seen:
        kernels = Kernels(compile_blocks=("vit", "llm"), compile_backend=seen.backend)
        compiled_model = model_layers(folder, attention, kernels)
        for name in names:
            index = compiled_model.names.index(name)
            layer, reference = compiled_model.build_layer(index), eager_model.build_layer(index)
            assert compiles_inside(layer) and not compiles_inside(reference)
            if swap is not None:
                swap(layer)
                swap(reference)
            vision = name.startswith("vit")
            config = compiled_model.meta.config
            hidden = (config.vision_config if vision else config.text_config).hidden_size
            first = None
            for shape in _shapes(vision, rng):
                grids, lengths = (shape, ()) if vision else ((), shape)
                rows = sum(t * h * w for t, h, w in grids) or sum(lengths)
                x = torch.randn(rows, hidden)
                weights = torch.randn(rows, hidden)

                def micro(x, grids=grids, lengths=lengths):
                    return _micro(x, attention, grids, lengths)

                d = compiled_model.defs[index]
                got = _loss_and_grads(layer, d, x, micro, weights, mode)
                want = _loss_and_grads(reference, d, x, micro, weights, mode)
                _assert_within(got, want, (name, shape))
                first = len(seen.ids) if first is None else first
            assert len(seen.ids) == first, (name, seen.ids)  # nothing after the first
    breaks = torch._dynamo.utils.counters["graph_break"]
    assert not breaks, dict(breaks)
    for top, every in seen.graphs:  # the recompute and the attention inside each graph
        assert any("tag_activation_checkpoint" in t for t in top), top
        assert any("vlmshard.packed_attention" in t for t in every), every
    return seen


def _targets(graph: torch.fx.GraphModule) -> set[str]:
    """The ops a captured graph calls, its higher-order ops' subgraphs included."""
    return {str(node.target) for module in graph.modules()
            if isinstance(module, torch.fx.GraphModule) for node in module.graph.nodes}


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["sdpa", "varlen"])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_compiled_blocks_hold_one_graph_and_eagers_numbers_over_20_micro_batches(folder, mode,
                                                                                 attention):
    """Inductor: a ViT block and a decoder layer, each compiled once (one frame, one
    compilation) over 20 micro-batches, no graph break, within 1e-5 of eager, recomputed
    selectively or whole (a partition's plan mixes both); on SDPA (the CPU's) and on torch's
    varlen kernel (the GPU's, its flash ops computed by ``flash_reference``), whose backward
    the compiled op calls itself."""
    from flash_reference import flash_on_cpu

    with flash_on_cpu() if attention == "varlen" else contextlib.nullcontext():
        seen = _check_blocks(folder, "inductor", ("vit_block_0", "llm_block_0"), mode=mode,
                             attention=attention)
    assert len(seen.ids) == 2, seen.ids


class StandInNormFunction(torch.autograd.Function):
    """RMSNorm as Liger's autograd function computes it (``llama`` casting: the normalized
    value in fp32, cast back, times the weight), its backward by hand; pure torch."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        rows = x.reshape(-1, x.shape[-1])
        rstd = torch.rsqrt(rows.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(rows, weight, rstd)
        return ((rows.float() * rstd).to(x.dtype) * weight).view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        rows, weight, rstd = ctx.saved_tensors
        shape = grad.shape
        grad = grad.reshape(rows.shape)
        normed = rows * rstd
        scaled = grad * weight
        dx = rstd * (scaled - normed * (scaled * normed).mean(-1, keepdim=True))
        return dx.view(shape), (grad * normed).sum(0), None


class StandInNorm(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return StandInNormFunction.apply(x, self.weight, self.eps)


def _stand_in_norms(layer: nn.Module) -> None:
    """The stand-in in place of each norm Liger swaps (``liger.NORMS``; Qwen's, no offset)."""
    from vlmshard.train.models import liger

    for parent in list(layer.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ in liger.NORMS:
                setattr(parent, name, StandInNorm(child))


def test_an_autograd_function_norm_in_a_recomputed_compiled_block(folder, monkeypatch):
    """Where Liger is asked for, the compiled decoder layer takes none of it (the stand-in
    goes to the final norm alone); with the stand-in inside the compiled layer anyway, the
    layer recomputed selectively traces into one graph holding the checkpoint, the attention op
    and the autograd function, compiles once over 20 micro-batches, and equals eager."""
    from vlmshard.train.models import liger

    monkeypatch.setattr(liger, "fuse", lambda layer, repeated: _stand_in_norms(layer))
    assert liger.NORMS["Qwen2RMSNorm"] == (0.0, "llama")  # the stand-in's arithmetic
    model = model_layers(folder, "sdpa", Kernels(liger=True, compile_blocks=("llm",),
                                                 compile_backend="aot_eager"))
    built = [model.build_layer(model.names.index(n)) for n in ("llm_block_0", "final_norm")]
    assert [any(isinstance(m, StandInNorm) for m in layer.modules()) for layer in built] == [
        False, True]
    seen = _check_blocks(folder, "aot_eager", ("llm_block_0",), swap=_stand_in_norms)
    assert len(seen.ids) == 1, seen.ids
    targets = seen.graphs[0][1]
    assert any("autograd_function_apply" in t for t in targets), targets


@pytest.mark.parametrize("scale", [8 ** -0.5, 0.3])  # the kernel's own (head dim 8), another
@pytest.mark.parametrize("repeated", [False, True])
@pytest.mark.parametrize("causal, window", [(True, None), (True, 4), (False, None)])
def test_the_attention_ops_backward_is_the_varlen_kernels_own(causal, window, repeated, scale,
                                                              monkeypatch):
    """Where torch's varlen kernel runs a compiled block's attention in one call, the op keeps
    the kernel's log-sum-exp and its backward is the kernel's own (one forward and one
    backward kernel call, not the forward again): on the reference kernels of FlashAttention's
    paper (``flash_reference``, the GPU's ops on this CPU), the output and q, k, v gradients
    (4 query heads, 2 K/V heads, 3 segments, a sliding window) within 1e-5 of SDPA on each
    segment alone; ``repeated``: K/V heads repeated to the query's, as for a torch whose
    ``varlen_attn`` has no ``enable_gqa`` (before 2.12), their gradients summed back. Under a
    torch whose kernel takes no window or no scale (2.10), a call that needs one runs each
    segment on SDPA, no kernel call (``make test-torch TORCH=2.10.0`` runs this test there)."""
    import inspect

    from flash_reference import against_sdpa
    from torch.nn.attention.varlen import varlen_attn

    from vlmshard.train import attention
    from vlmshard.train.attention import packed_attention

    if repeated:
        names = attention.varlen_parameters
        monkeypatch.setattr(attention, "varlen_parameters",
                            lambda kernel: names(kernel) - {"enable_gqa"})

    def attend(query, key, value, cu):
        return packed_attention(query, key, value, cu, cu, torch.zeros(0, 3, dtype=torch.long),
                                "varlen", causal, 2, scale, window)[0]

    takes = inspect.signature(varlen_attn).parameters
    kernel = (not window or "window_size" in takes) and (scale == 8 ** -0.5 or "scale" in takes)
    expected = {"forward": 1, "backward": 1} if kernel else {}
    assert against_sdpa(attend, causal, window, scale) == expected
