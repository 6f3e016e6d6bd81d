"""The step clock: a step's time by part of the model, recompute apart, from layers whose
forward and backward take known times; the host-sync counter; DeepSpeed's own timers off."""

from __future__ import annotations

import contextlib
import inspect
import time

import pytest
import torch
from torch import nn

from vlmshard.model_sizes import (
    TERM_FIELDS,
    CostTerms,
    ModelConfig,
    VisionConfig,
    trainer_layer_work,
    training_flops,
)
from vlmshard.train.clock import HostSyncs, StageClock, allocator_calls
from vlmshard.train.micro import Micro, Phase
from vlmshard.train.models.layers import LayerDef
from vlmshard.train.pipeline import run_layers
from vlmshard.train.train_log import rank_timing, recompute_flops


class Sleep(torch.autograd.Function):
    """Sleeps ``layer.forward_s`` in forward (again when recomputed) and ``layer.backward_s`` in
    backward, recording how long each sleep really took (a busy machine overruns them)."""

    @staticmethod
    def forward(ctx, x, layer: SleepLayer):
        layer.forwards.append(_sleep(layer.forward_s))
        ctx.layer = layer
        out = x * 1.0
        ctx.save_for_backward(out)  # saved after the sleep: a recompute runs the whole forward
        return out

    @staticmethod
    def backward(ctx, grad):
        ctx.layer.backwards.append(_sleep(ctx.layer.backward_s))
        return grad * ctx.saved_tensors[0].detach() * 0 + grad, None


def _sleep(seconds: float) -> float:
    start = time.perf_counter()
    time.sleep(seconds)
    return time.perf_counter() - start


class SleepLayer(nn.Module):
    def __init__(self, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))
        self.forward_s, self.backward_s = forward_s, backward_s
        self.forwards: list[float] = []  # a recomputed layer's: forward, recompute, forward, ...
        self.backwards: list[float] = []

    def forward(self, micro: Micro) -> torch.Tensor:
        return Sleep.apply(micro.x * self.weight, self)


# name, forward s, backward s, recomputed whole
LAYERS = [("vit_embed", 0.01, 0.02, False), ("vit_block_0", 0.02, 0.03, True),
          ("projector", 0.01, 0.03, False), ("embed_tokens", 0.01, 0.01, False),
          ("llm_block_0", 0.03, 0.04, True), ("final_norm", 0.01, 0.01, False),
          ("head", 0.01, 0.02, False)]
MICRO_BATCHES = 2


def _micro() -> Micro:
    empty = torch.zeros(0, dtype=torch.long)
    return Micro(x=torch.ones(3, 4), input_ids=empty, position_ids=empty, labels=empty,
                 host=None, backend="sdpa", phase=Phase("vision", 1), wire=())


@pytest.mark.parametrize("engine", ["pipeline", "plain"])
def test_the_clock_splits_a_step_by_part_with_recompute_apart(engine):
    """Per part, the layers' forward and backward sleeps (recompute excluded), the recomputed
    layers' forward sleeps as recompute, the optimizer's step; and the breakdown covers the
    step: its parts sum to the step within 5% (recompute counted in its layers' parts too would
    add 10%), ``other`` under 5% of it. (Sleeps overrun on a busy machine: the upper bounds are
    loose.) A pipeline stage's
    backward is timed by its output's and parameters' hooks, the plain engine's around its
    ``backward`` call."""
    layers = [SleepLayer(f, b) for _, f, b, _ in LAYERS]
    defs = [LayerDef(name, None, Phase("x")) for name, *_ in LAYERS]
    modes = ["full" if again else None for *_, again in LAYERS]
    clock = StageClock(cuda=False)
    params = [layer.weight for layer in layers]
    optimizer = torch.optim.SGD(params, lr=0.1)
    clock.watch_optimizer(optimizer)
    if engine == "pipeline":
        clock.watch(params)
    start = time.perf_counter()
    clock.start_step()
    for _ in range(MICRO_BATCHES):
        clock.forward_begin()
        loss = run_layers(layers, defs, _micro(), modes, clock).x.sum()
        if engine == "pipeline":
            loss.register_hook(clock.output_grad_arrives("head"))
        else:
            clock.forward_part("head")
            clock.backward_begin("head")
        loss.backward()
        if engine == "plain":
            clock.backward_done()
    optimizer_slept = []  # before the clock's hook: timed
    optimizer.register_step_pre_hook(lambda *_: optimizer_slept.append(_sleep(0.02)))
    optimizer.step()
    times = clock.take()
    step_s = time.perf_counter() - start

    # what each layer really slept: its forwards (a recomputed layer's every other call is the
    # recompute), its backwards
    by_name = {name: layer for (name, *_), layer in zip(LAYERS, layers)}
    recomputes = {name: again for name, _, _, again in LAYERS}

    def forward_slept(names: set[str]) -> float:
        return sum(sum(by_name[n].forwards[::2 if recomputes[n] else 1]) for n in names)

    def slept(names: set[str]) -> float:
        return forward_slept(names) + sum(sum(by_name[n].backwards) for n in names)

    assert all(len(layer.backwards) == MICRO_BATCHES for layer in layers)
    assert all(len(by_name[n].forwards) == MICRO_BATCHES * (1 + again)
               for n, again in recomputes.items())
    parts = {"vit": {"vit_embed", "vit_block_0"}, "projector": {"projector"},
             "llm": {"embed_tokens", "llm_block_0", "final_norm"}, "head": {"head"}}
    for part, names in parts.items():
        expected = slept(names)
        assert expected <= times.parts[part] <= 2 * expected, (part, times.parts)
    recomputed = sum(sum(by_name[n].forwards[1::2]) for n in ("vit_block_0", "llm_block_0"))
    assert recomputed <= times.recompute_s <= 2 * recomputed
    assert optimizer_slept[0] <= times.optimizer_s <= 2 * optimizer_slept[0]
    forward = forward_slept(set().union(*parts.values()))
    assert forward <= times.forward_s <= 2 * forward
    # each mark's host reading: on CPU the device is the host, so the same seconds
    assert times.host == pytest.approx({**times.parts, "recompute": times.recompute_s,
                                        "optimizer": times.optimizer_s}, rel=1e-9)
    breakdown = rank_timing(rank=0, stage=0, dp_rank=0, forward_s=times.forward_s,
                            backward_s=times.backward_s, pipeline_s=times.pipeline_s,
                            step_time_s=step_s, load_s=0.01, parts=times.parts,
                            recompute_s=times.recompute_s,
                            optimizer_s=times.optimizer_s)["time_breakdown"]
    assert set(breakdown) == {"vit", "projector", "llm", "head", "recompute", "optimizer",
                              "pipeline_wait", "data_wait", "other"}
    assert breakdown["data_wait"] == 0.01
    assert sum(breakdown.values()) == pytest.approx(step_s + 0.01, rel=0.05)
    assert 0 <= breakdown["other"] < 0.05 * (step_s + 0.01)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_host_time_on_cuda_tells_a_host_bound_part_from_a_device_bound_one():
    """On a GPU a part of a few long kernels takes the host far less time than the device; a
    part of many tiny kernels, launched one by one from Python, takes the host as long as the
    device (which waits for each launch). Each part starts on an idle device."""
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    tiny = torch.zeros(1, device="cuda")
    clock = StageClock(cuda=True)
    torch.cuda.synchronize()
    clock.start_step()
    clock.forward_begin()
    for _ in range(20):
        big @ big
    clock.forward_part("vit")
    torch.cuda.synchronize()
    clock.forward_begin()
    for _ in range(3000):
        tiny.add_(1)
    clock.forward_part("llm")
    times = clock.take()
    assert times.host["vit"] < 0.2 * times.parts["vit"], times
    assert times.host["llm"] > 0.8 * times.parts["llm"], times


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_allocator_calls_on_cuda_count_what_the_allocators_did():
    """A block larger than any cached one is a device allocation, emptying the cache a free;
    pinning a host block larger than any cached one a page-locked allocation, with its time."""
    device = torch.device("cuda")
    torch.cuda.empty_cache()
    before = allocator_calls(device)
    block = torch.empty(2**31 + 1, dtype=torch.uint8, device=device)
    pinned = torch.empty(2**29 + 1, dtype=torch.uint8).pin_memory()
    del block
    torch.cuda.empty_cache()
    made = {name: n - before[name] for name, n in allocator_calls(device).items()}
    assert made["device_allocs"] >= 1 and made["device_frees"] >= 1, made
    assert made["pinned_allocs"] >= 1 and made["pinned_alloc_s"] > 0, made
    assert pinned.is_pinned()


def test_overlapping_parts_sum_to_more_than_the_step():
    """``other`` is the remainder, never negative: parts measured twice show in the sum."""
    breakdown = rank_timing(rank=0, stage=0, dp_rank=0, forward_s=1.0, backward_s=2.0,
                            pipeline_s=3.0, step_time_s=3.5, load_s=0.0,
                            parts={"vit": 1.0, "llm": 2.0}, recompute_s=0.5,
                            optimizer_s=0.5)["time_breakdown"]
    assert breakdown["other"] == 0 and sum(breakdown.values()) == 4.0


def test_host_syncs_counts_torch_cuda_synchronize():
    """``torch.cuda.synchronize`` counts once, at the line that called it (the sync debug mode
    sees it on some torch versions, not on others: torch 2.11 on an H200 counted it twice),
    and the call is still made (which a CPU build of torch refuses, after it was counted)."""
    original = torch.cuda.synchronize
    with HostSyncs(True) as syncs:
        # a CPU build asserts it has no CUDA, a CUDA build without a driver raises
        no_device = contextlib.suppress(AssertionError, RuntimeError)
        with no_device if not torch.cuda.is_available() else contextlib.nullcontext():
            line = inspect.currentframe().f_lineno + 1
            torch.cuda.synchronize()
    assert syncs.count == 1 and torch.cuda.synchronize is original, syncs.sites
    assert syncs.sites == {f"tests/test_clock.py:{line}": 1}
    with HostSyncs(False) as off:
        assert torch.cuda.synchronize is original
    assert off.count == 0


def test_deepspeed_times_no_micro_batch():
    """DeepSpeed, reading the trainer's config, keeps its throughput timer (which synchronises
    the device around every micro-batch) and its wall-clock breakdown off."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from vlmshard.train.config import TrainConfig
    from vlmshard.train.engine import deepspeed_config

    for precision in ("bf16", "fp32"):
        cfg = TrainConfig(shards="s", out="o", precision=precision)
        parsed = DeepSpeedConfig(deepspeed_config(cfg, 4))
        assert parsed.timers_config.enabled is False
        assert parsed.wall_clock_breakdown is False


def test_recompute_flops_are_the_recomputed_forwards():
    """Nothing recomputed: nothing again (the LM loss computes its gradients in its forward, its
    logits' matmul never runs twice); every layer recomputed: the whole forward (a third of the
    training FLOPs) on top, a Qwen-like ViT's attention across images and within windows too,
    and the head's forward as the fused loss runs it: the logits and both gradients, 3 × 2 ×
    hidden × vocabulary per supervised token."""
    config = ModelConfig(vision=VisionConfig(image_size=28, patch_size=14, layers=2,
                                             fused_qkv=True, window=2, full_blocks=(1,)))
    names = config.layer_names()
    names[names.index("projector_merge")] = "projector"
    work = trainer_layer_work(names, config)
    head = 2 * config.llm.hidden * config.llm.vocab_size
    trained = ["train"] * len(names)
    assert recompute_flops(names, work, trained, []) == CostTerms()
    every = recompute_flops(names, work, trained, names)
    total = training_flops(config)
    assert total.vit_squares > 0 and total.vit_windows > 0
    # the training FLOPs are three forwards, but the patch embedding's two (its input is the
    # pixels: no gradient to them)
    embed = work[names.index("vit_embed")].flops
    for key in set(TERM_FIELDS) - {"supervised"}:
        assert getattr(every, key) == pytest.approx((getattr(total, key)
                                                     + getattr(embed, key)) / 3)
    assert every.supervised == 3 * head
