"""The host's time for one micro-batch's forward + backward through a whole model's layers, at
full depth, with the device's work taken away: what Python and dispatch cost per micro-batch,
which on a GPU must stay under the kernels' time (~0.4 s a micro-batch on an H100) for the
device never to wait.

    python benchmarks/host_path_bench.py [--repeats 7] [--samples 5] [--compiled]
    python benchmarks/host_path_bench.py --dtype bfloat16 | --attention sdpa
    python benchmarks/host_path_bench.py --smoke            # 2 ViT + 2 LLM blocks, 1 repeat

The model: Qwen3-VL-2B's layer stack (24 ViT blocks, DeepStack after 5, 11 and 17; 28 decoder
layers; its heads and K/V heads, head tied) at tiny widths (``DEPTH``: hidden sizes shrunk,
heads kept, so every layer dispatches the ops it does at full width), random weights, on one
CPU thread. Attention runs the GPU's path (torch's varlen kernel, one call a layer, the ViT's
images in one call), its kernels stand-ins that only allocate their outputs
(``stand_in_varlen_kernels``). The micro-batch: the tests' rows (``tests/hf_reference.py``:
photos, one text-only sample) repeated to ``--samples``, preprocessed, packed into one
micro-batch and read by the trainer's loader. The layers are the trainer's
(``hf_model.model_layers``, a GPU's default kernels but Liger: ``vit_varlen``,
``patch_linear``), run as a stage holding all of them runs them (``pipeline.run_layers``, with
its ``StageClock``). Times are the process's CPU time (a shared machine's waits are no host
work); each op's CPU kernel at these widths still costs a few microseconds, about what a
GPU's launch costs the host.

Per recompute plan: ``none``; ``full`` and ``selective`` (every ViT block and decoder layer so);
``default``, the plan the search gives Qwen3-VL-2B's published sizes on one 80 GB H100
(``vlmshard.partition.search_partition`` over ``trainer_layer_work``, PP=1, at the 4-sample caps
of the H200 runs: 11,745 tiles, 22,399 tokens). Printed per plan: the host's milliseconds per
micro-batch (median of ``--repeats``, the plans interleaved), the aten ops dispatched (counted
in a separate pass by a ``TorchDispatchMode``, forward and backward), and the stage clock's
split by part. Then, for the default plan, what it computes once per micro-batch outside the
layers' ops (``Micro.cached``: rotary tables, ViT geometry, attention spans;
``first_micro``), and the ViT's host-side geometry at the H100 run's image sizes (11 images
of 64x64 patches), which this micro-batch's small images understate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from unittest import mock

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]

# Qwen3-VL-2B's depth and heads (``gpu_bench.QWEN3_VL_2B``) at tiny widths: ViT head dim 4,
# LLM head dim 8 (mRoPE sections halved to fit it)
DEPTH = {
    "text_sizes": dict(hidden_size=32, intermediate_size=32, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=8,
                       rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                        "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
    "vision_sizes": dict(depth=24, hidden_size=64, intermediate_size=32, num_heads=16,
                         out_hidden_size=32, num_position_embeddings=2304,
                         deepstack_visual_indexes=[5, 11, 17]),
}
SMOKE = {"text_sizes": dict(DEPTH["text_sizes"], num_hidden_layers=2),
         "vision_sizes": dict(DEPTH["vision_sizes"], depth=2, deepstack_visual_indexes=[0])}
# images of at most 16 merged patches (64 patches): the ViT's rows few, their kernels short
MAX_PIXELS = 32 * 32 * 16
H100_BYTES = int(79.19 * 2**30)
CAPS = (11745, 22399)  # tiles, tokens: the H200 runs' 4-sample caps (BENCHMARKS.md)
H100_GRIDS = [(1, 64, 64)] * 11  # the H100 micro-batch's images, as host_overhead_bench's


@dataclass
class Run:
    """One timed forward + backward: the host's CPU seconds (and wall seconds), and the stage
    clock's by part."""

    seconds: float
    wall: float
    parts: dict[str, float]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--samples", type=int, default=5, help="samples in the micro-batch")
    p.add_argument("--smoke", action="store_true", help="2 ViT + 2 LLM blocks, one repeat")
    p.add_argument("--attention", choices=("varlen", "sdpa"), default="varlen",
                   help="varlen (default): the GPU's backend, every layer's attention one call "
                        "of torch's varlen kernel, run by a stand-in that only allocates its "
                        "outputs (``stand_in_varlen_kernels``); sdpa: the CPU's, SDPA's CPU "
                        "kernels on each sample (and image size) alone")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the layers' and pixels' dtype: float32 (default), whose CPU kernels "
                        "are the fastest; bfloat16, a GPU rank's, dispatches its casts too "
                        "(the norms' and rotary's to float32 and back), but its CPU matmuls "
                        "cost ~5x float32's")
    p.add_argument("--compiled", action="store_true",
                   help="also none and selective with every ViT block and decoder layer "
                        "compiled (``--compile-blocks vit llm``; compiled at the warm-up)")
    p.add_argument("--by-source", action="store_true",
                   help="also the none plan's forward ops by the source file that called them")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args()
    import torch

    from vlmshard.train.hf_model import model_layers

    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="host-path-")
    if args.attention == "varlen":
        stand_in_varlen_kernels()
    model, layers, batch = setup(root, SMOKE if args.smoke else DEPTH, args.samples,
                                 args.attention, getattr(torch, args.dtype))
    plans = {name: (model, layers, modes)
             for name, modes in recompute_plans(model, default=not args.smoke).items()}
    if args.compiled:
        compiled = model_layers(model.path, args.attention,
                                replace(model.kernels, compile_blocks=("vit", "llm")))
        built = compiled.build_all(dtype=getattr(torch, args.dtype))
        # each plan's recompute inside the compiled graphs (``recompute.run_layer``)
        for name in list(plans):
            plans[f"{name}+compiled"] = (compiled, built, plans[name][2])
    repeats = 1 if args.smoke else args.repeats
    print(f"{len(model.names)} layers of {model.family} at tiny widths, {batch['num_samples']} "
          f"samples, {len(batch['image_grid_thw'])} images, {batch['num_tiles']} tiles, "
          f"{batch['num_tokens']} tokens; {args.attention} attention, {args.dtype}; torch "
          f"{torch.__version__}, 1 thread; median of "
          f"{repeats} interleaved repeats")
    runs = {name: [] for name in plans}
    for _ in range(repeats + 1):  # the first: warm-up
        for name, plan in plans.items():
            runs[name].append(step(batch, *plan))
    table = {name: summary(runs[name][1:], None if plan[0].kernels.compile_blocks
                           else count_ops(batch, *plan), plan[2])
             for name, plan in plans.items()}
    print(f"{'plan':<18} {'whole':>5} {'sel.':>4} {'host ms':>8} {'wall ms':>8} {'ops fwd':>7} "
          f"{'ops bwd':>7} {'us/op':>6} {'attn ms':>7}  by part (ms)")
    for name, row in table.items():
        counted = (f"{row['ops_forward']:>7} {row['ops_backward']:>7} {row['us_per_op']:6.1f} "
                   f"{row['attention_ms']:7.1f}"
                   if "ops_forward" in row else f"{'-':>7} {'-':>7} {'-':>6} {'-':>7}")
        print(f"{name:<18} {row['whole']:>5} {row['selective']:>4} {row['host_ms']:8.1f} "
              f"{row['wall_ms']:8.1f} {counted}  "
              + ", ".join(f"{k} {v:.1f}" for k, v in row["parts_ms"].items() if v))
    print("forward ops per layer, none: " + ", ".join(
        f"{kind} {n}" for kind, n in table["none"]["forward_ops_per_layer"].items()))
    if args.by_source:
        sources = forward_ops_by_source(batch, *plans["none"])
        print(f"forward ops of none by caller ({sum(sources.values())}): " + ", ".join(
            f"{source} {n}" for source, n in sources.most_common()))
    where = "default" if "default" in plans else "none"
    extra = breakdown(batch, *plans[where])
    print(f"\n{where}: per micro-batch outside the layers' ops (ms): "
          + ", ".join(f"{k} {v:.2f}" for k, v in extra.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"plans": table, "outside_ops_ms": extra, "torch": torch.__version__,
                       "samples": batch["num_samples"], "tiles": batch["num_tiles"],
                       "tokens": batch["num_tokens"]}, f, indent=1)


def summary(kept: list[Run], ops: Ops | None, modes: list) -> dict:
    """A plan's row: medians of its timed runs, its op counts (None: compiled blocks, whose
    graphs no dispatch mode may watch)."""
    host = statistics.median(r.seconds for r in kept)
    row = {"whole": modes.count("full"), "selective": modes.count("selective"),
           "host_ms": host * 1e3, "wall_ms": statistics.median(r.wall for r in kept) * 1e3,
           "parts_ms": {part: statistics.median(r.parts[part] for r in kept) * 1e3
                        for part in kept[0].parts}}
    if ops is None:
        return row
    dispatched = sum(ops.forward.values()) + sum(ops.backward.values())
    return {**row, "ops_forward": sum(ops.forward.values()),
            "ops_backward": sum(ops.backward.values()), "us_per_op": host / dispatched * 1e6,
            "attention_ms": ops.attention_s * 1e3,
            "forward_ops_per_layer": {kind: n // ops.layers[kind]
                                      for kind, n in ops.by_kind.items() if kind}}


def setup(root: str, sizes: dict, samples: int, attention: str, dtype):
    """The tiny full-depth folder, its trainer layers on the ``attention`` backend in
    ``dtype``, and one loader micro-batch of ``samples`` samples."""
    from hf_reference import ROWS, make_shards

    from vlmshard.families import tiny_folder
    from vlmshard.shards.loader import ShardDataset
    from vlmshard.train.hf_model import model_layers
    from vlmshard.train.kernels import Kernels

    folder = tiny_folder("qwen3_vl", os.path.join(root, "model"), max_pixels=MAX_PIXELS,
                         tie_word_embeddings=True, **sizes)
    rows = (ROWS * samples)[:samples]
    shards = make_shards(folder, Path(root), rows=rows,
                         target_samples=samples, micro_batches=1)
    batch = max(ShardDataset(shards, pixel_dtype=dtype), key=lambda b: b["num_samples"])
    model = model_layers(folder, attention, Kernels(vit_varlen=True, patch_linear=True))
    return model, model.build_all(dtype=dtype), batch


_STAND_INS = []


def stand_in_varlen_kernels() -> None:
    """CPU kernels for the flash ops torch's varlen attention calls (a GPU's only), which
    allocate their outputs (zeros, in the shapes of torch's fake kernels) and compute
    nothing: every layer then dispatches what it dispatches on a GPU, one attention call a
    layer, and the attention's device work is gone."""
    import torch

    def forward(query, key, value, *args, **kwargs):
        lse = query.new_zeros(query.shape[1], query.shape[0], dtype=torch.float32)
        return (torch.zeros_like(query), lse, query.new_zeros(2, dtype=torch.uint64),
                query.new_empty(0), query.new_empty(0))

    def backward(grad_out, query, key, value, *args, **kwargs):
        return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)

    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_flash_attention_forward", forward, "CPU")
    lib.impl("_flash_attention_backward", backward, "CPU")
    _STAND_INS.append(lib)  # registered while the library object lives


def recompute_plans(model, default: bool) -> dict[str, list]:
    """Per plan, each layer's recompute mode (``pipeline.recompute_modes``)."""
    from vlmshard.train.pipeline import recompute_modes

    blocks = {n for n in model.names if n.startswith(("vit_block_", "llm_block_"))}
    plans = {"none": (set(), set()), "full": (blocks, set()), "selective": (set(), blocks)}
    if default:
        plans["default"] = h100_plan(model.names)
    return {name: recompute_modes(model.names, whole, sel, model)
            for name, (whole, sel) in plans.items()}


def h100_plan(names: list[str]) -> tuple[set[str], set[str]]:
    """The layers the search recomputes whole and selectively for Qwen3-VL-2B (head tied) on
    one 80 GB H100 at ``CAPS``, with the kernels a GPU rank runs (the ViT in one varlen call,
    Liger in the LLM, K/V heads as this torch's varlen kernel takes them)."""
    from memory_bench import qwen3_vl_2b

    from vlmshard.model_sizes import CostTerms, Saves, bytes_per_param, trainer_layer_work
    from vlmshard.partition import Machine, analytic_layer_costs, search_partition
    from vlmshard.train.attention import repeats_kv_heads

    saves = Saves(vit_one_call=True, liger_llm=True, kv_repeated=repeats_kv_heads("varlen"))
    work = trainer_layer_work(names, qwen3_vl_2b(tied=True), saves)
    caps = CostTerms(*CAPS)
    costs = analytic_layer_costs(work, time_size=caps, memory_size=caps, flops_per_s=1.0,
                                 bytes_per_param=bytes_per_param("bf16", 1))
    plan = search_partition(costs, 1, Machine.for_device(H100_BYTES))
    return {names[i] for i in plan.recompute}, {names[i] for i in plan.selective}


def step(batch, model, layers, modes) -> Run:
    """One micro-batch's forward + backward as a stage holding every layer runs it, timed on
    the process's CPU clock (the stage clock too): on a shared machine, time spent waiting
    for a core is not the host's work."""
    from types import SimpleNamespace

    from vlmshard.train import clock as clocks
    from vlmshard.train.pipeline import run_layers

    zero_grads(layers)
    with mock.patch.object(clocks, "time", SimpleNamespace(perf_counter=time.process_time)):
        clock = clocks.StageClock(cuda=False)
        clock.start_step()
        start, wall = time.process_time(), time.perf_counter()
        clock.forward_begin()
        loss = run_layers(layers, model.defs, model.first_micro(batch), modes, clock).x
        loss.register_hook(clock.output_grad_arrives("head"))
        loss.backward()
        clock.backward_done()
        seconds, wall = time.process_time() - start, time.perf_counter() - wall
        return Run(seconds, wall, clock.take().host)


@dataclass
class Ops:
    """What one forward + backward dispatched: aten ops by name, forward and backward, the
    forward's by layer kind, and the seconds spent inside the attention ops (with
    ``--attention sdpa`` SDPA's CPU kernels: compute a GPU runs beside the host, which tiny
    widths do not make negligible)."""

    forward: Counter
    backward: Counter
    by_kind: Counter
    layers: Counter  # layers of each kind
    attention_s: float


def count_ops(batch, model, layers, modes) -> Ops:
    """One forward + backward under a counting ``TorchDispatchMode`` (not timed otherwise)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from vlmshard.train.pipeline import run_layers

    current = [""]
    by_kind, seconds = Counter(), Counter()
    # by layer kind (DeepStack's with the others), a tied embedding and head as one module
    names = {}
    for layer, d in zip(layers, model.defs):
        names.setdefault(id(layer), []).append(d.kind.split("_deepstack")[0])
    kinds = ["+".join(names[id(layer)]) for layer in layers]

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            self.ops[name] += 1
            by_kind[current[0]] += 1
            start = time.process_time()
            out = func(*args, **(kwargs or {}))
            if "attention" in name or "attn" in name:
                seconds["attention"] += time.process_time() - start
            return out

    hooks = [layer.register_forward_pre_hook(
        lambda module, args, kind=kind: current.__setitem__(0, kind))
        for layer, kind in zip(layers, kinds)]
    try:
        with Count() as forward:
            loss = run_layers(layers, model.defs, model.first_micro(batch), modes).x
        forward_kinds = Counter(by_kind)
        current[0] = "backward"
        with Count() as backward:
            loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
    zero_grads(layers)
    return Ops(forward.ops, backward.ops, forward_kinds,
               Counter(kinds[i] for i, layer in enumerate(layers)
                       if i == layers.index(layer)), seconds["attention"])


def forward_ops_by_source(batch, model, layers, modes) -> Counter:
    """One forward's aten ops by the file (outside torch) of the innermost frame that called
    them: a ``transformers`` module, vlmshard's own code."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    from vlmshard.train.pipeline import run_layers

    sources = Counter()

    class BySource(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            frame = next(f for f in reversed(traceback.extract_stack())
                         if "/torch/" not in f.filename and f.filename != __file__)
            sources[frame.filename.split("site-packages/")[-1].removeprefix(REPO + "/")] += 1
            return func(*args, **(kwargs or {}))

    with BySource():
        run_layers(layers, model.defs, model.first_micro(batch), modes)
    zero_grads(layers)
    return sources


def zero_grads(layers) -> None:
    for layer in layers:
        for param in layer.parameters():
            param.grad = None


def breakdown(batch, model, layers, modes) -> dict[str, float]:
    """Milliseconds a micro-batch of ``modes`` spends outside its layers' aten ops: each
    table the layers compute once per micro-batch (``Micro.cached``), the micro-batch's
    metadata and slicing (``first_micro``); the ViT's host geometry at the H100 micro-batch's
    image sizes; and, for scale, one bare aten op's dispatch."""
    import torch

    from vlmshard.train.micro import Micro

    spent = Counter()
    plain_cached = Micro.cached

    def timed_cached(self, key, compute):
        if key in self.cache:
            return self.cache[key]
        start = time.process_time()
        try:
            return plain_cached(self, key, compute)
        finally:
            spent[key.removesuffix("_False")] += (time.process_time() - start) * 1e3

    with mock.patch.object(Micro, "cached", timed_cached):
        step(batch, model, layers, modes)
    spent["first_micro"] = per_call(lambda: model.first_micro(batch), 20) * 1e3
    spent["vit_geometry_at_h100_images"] = vit_geometry_seconds(H100_GRIDS) * 1e3
    a, b = torch.ones(4), torch.ones(4)
    spent["one_aten_add_x1000"] = per_call(lambda: torch.add(a, b), 2000) * 1e6
    return dict(spent)


def per_call(fn, calls: int) -> float:
    """Seconds per call of ``fn``, the median of 5 runs of ``calls``."""
    took = []
    for _ in range(5):
        start = time.process_time()
        for _ in range(calls):
            fn()
        took.append((time.process_time() - start) / calls)
    return statistics.median(took)


def vit_geometry_seconds(grids) -> float:
    """The median time of what Qwen3-VL's ViT layers compute on the host from the image grids
    (``VisionGeometry``, ``PositionedEmbedding``) before their first kernel."""
    import torch
    from transformers.vision_utils import (
        get_vision_cu_seqlens,
        get_vision_interpolation_indices_and_weights,
        get_vision_position_ids,
    )

    grids = torch.tensor(grids)
    def prepare() -> None:
        get_vision_cu_seqlens(grids)
        get_vision_position_ids(grids, 2)
        get_vision_interpolation_indices_and_weights(grids, 48, mode="bilinear",
                                                     align_corners=True, spatial_merge_size=2)

    return per_call(prepare, 3)


if __name__ == "__main__":
    main()
