"""The host's time for one decoder layer's forward + backward under each recompute mode, on inputs
so small that the host's work is all there is: what a step pays in Python and dispatch per layer,
which on a GPU hides behind the kernels only while the device is slower.

    python benchmarks/host_overhead_bench.py [--family qwen3_vl] [--repeats 7] [--calls 200]
    python benchmarks/host_overhead_bench.py --contention [--repeats 30]
    python benchmarks/host_overhead_bench.py --vit-batches [--repeats 7] [--calls 20]

A tiny folder of the family (the tests' ``make_folder``: random weights, the family's real
``transformers`` modules), its first plain decoder layer, 16 tokens in two samples, one thread.
The modes run interleaved (each repeat runs every mode once, ``--calls`` times each), and the
median per call is printed beside the no-recompute median (``vlmshard.train.recompute``:
``full`` runs the forward again; ``selective`` runs every op through torch's selective
checkpoint dispatch mode, in the forward and again in backward).

``--contention``: the ViT's own host work for one micro-batch, before its first kernel (the
patch positions, image boundaries and the resampled position table's indices and weights,
computed by ``transformers.vision_utils`` as ``VisionGeometry`` and ``PositionedEmbedding`` call
it; 11 images of 64×64 patches, Qwen3-VL-2B's 48×48 table), with one intra-op thread and with
one per CPU, alone and beside as many busy processes as CPUs (a GPU rank's loader workers):
what ``vlmshard.train.trainer.gpu_rank_threads`` is for.

``--vit-batches``: a tiny Qwen2.5-VL's ViT blocks, windowed and full, forward + backward over 4
images of 32×32 patches (16 windows of 8×8 patches each) on SDPA, as the trainer runs them
(``vlmshard.train.attention.packed_sdpa``: consecutive segments of one length in one batched
call) and with one SDPA call per window or image (what it did before), interleaved; one thread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = (None, "full", "selective")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="qwen3_vl", help="a family of the tests' tiny folders")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--calls", type=int, help="forward + backward calls per repeat (default 200, "
                                             "with --vit-batches 20)")
    p.add_argument("--contention", action="store_true",
                   help="the ViT's per-micro-batch host work by thread count, beside busy "
                        "processes")
    p.add_argument("--vit-batches", action="store_true",
                   help="a windowed ViT's blocks with equal windows batched in one SDPA call, "
                        "against one call per window")
    args = p.parse_args()
    if args.contention:
        contention(args.repeats)
        return
    if args.vit_batches:
        vit_batches(args.repeats, args.calls or 20)
        return
    calls = args.calls or 200

    import torch

    sys.path.insert(0, os.path.join(REPO, "tests"))
    from hf_reference import make_folder

    from vlmshard.train.hf_model import model_layers
    from vlmshard.train.micro import HostMeta, LayerOutput, Micro, Phase
    from vlmshard.train.recompute import run_layer

    torch.set_num_threads(1)
    model = model_layers(make_folder(args.family, os.path.join(tempfile.mkdtemp(), "model")))
    index = next(i for i, d in enumerate(model.defs)
                 if d.name.startswith("llm_block") and not d.variant)
    layer = model.build_layer(index)
    hidden = model.meta.config.text_config.hidden_size
    lengths = [8, 8]
    n = sum(lengths)
    positions = torch.cat([torch.arange(k) for k in lengths]).expand(3, n)
    host = HostMeta(qv=0, qt=n, tiles=0, tokens=n, image_tokens=0, supervised=0, grids=[],
                    sample_lengths=lengths, image_runs=[])

    def call(mode) -> None:
        x = torch.randn(n, hidden, requires_grad=True)
        micro = Micro(x=x, input_ids=torch.zeros(n, dtype=torch.long), position_ids=positions,
                      labels=torch.zeros(n, dtype=torch.long), host=host, backend="sdpa",
                      phase=Phase("rows", 1), wire=())
        out = run_layer(layer, micro, mode)
        (out.x if isinstance(out, LayerOutput) else out).sum().backward()

    seconds = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            start = time.perf_counter()
            for _ in range(calls):
                call(mode)
            seconds[mode].append((time.perf_counter() - start) / calls)
    plain = statistics.median(seconds[None])
    print(f"{model.names[index]} of {args.family}, {n} tokens, torch {torch.__version__}")
    for mode in MODES:
        median = statistics.median(seconds[mode])
        print(f"{mode or 'none':<10} {median * 1e3:7.3f} ms per forward + backward "
              f"({median / plain:.2f}x none)")


def vit_batches(repeats: int, calls: int) -> None:
    from unittest import mock

    import torch

    sys.path.insert(0, os.path.join(REPO, "tests"))
    from hf_reference import make_folder

    from vlmshard.train import attention
    from vlmshard.train.hf_model import model_layers
    from vlmshard.train.micro import HostMeta, Micro, Phase

    torch.set_num_threads(1)
    model = model_layers(make_folder("qwen2_5_vl", os.path.join(tempfile.mkdtemp(), "model")))
    blocks = {d.variant or "windowed": i for i, d in enumerate(model.defs)
              if d.name.startswith("vit_block_")}
    grids = [(1, 32, 32)] * 4
    patches = sum(t * h * w for t, h, w in grids)
    hidden = model.meta.config.vision_config.hidden_size
    host = HostMeta(qv=patches, qt=0, tiles=patches, tokens=0, image_tokens=0, supervised=0,
                    grids=grids, sample_lengths=[], image_runs=[])

    def call(layer) -> None:
        x = torch.randn(patches, hidden, requires_grad=True)
        micro = Micro(x=x, input_ids=torch.zeros(0, dtype=torch.long),
                      position_ids=torch.zeros(3, 0, dtype=torch.long),
                      labels=torch.zeros(0, dtype=torch.long), host=host, backend="sdpa",
                      phase=Phase("rows", 1), wire=())
        layer(micro).sum().backward()

    def one_a_segment(lengths, masked):
        return [(i, i + 1) for i in range(len(lengths))]

    ways = {"batched": attention.sdpa_batches, "one a segment": one_a_segment}
    print(f"a tiny Qwen2.5-VL's ViT blocks, {len(grids)} images of 32x32 patches, "
          f"torch {torch.__version__}; median of {repeats} x {calls} forward + backward calls")
    for kind, index in sorted(blocks.items()):
        layer = model.build_layer(index)
        seconds = {way: [] for way in ways}
        for _ in range(repeats):
            for way, batches in ways.items():
                with mock.patch.object(attention, "sdpa_batches", batches):
                    call(layer)  # warm
                    start = time.perf_counter()
                    for _ in range(calls):
                        call(layer)
                    seconds[way].append((time.perf_counter() - start) / calls)
        batched, alone = (statistics.median(seconds[way]) for way in ways)
        print(f"{kind:<9} block: batched {batched * 1e3:7.2f} ms, one call a segment "
              f"{alone * 1e3:7.2f} ms ({alone / batched:.2f}x)")


def contention(repeats: int) -> None:
    import subprocess

    import torch
    from transformers.vision_utils import (
        get_vision_cu_seqlens,
        get_vision_interpolation_indices_and_weights,
        get_vision_position_ids,
    )

    from vlmshard.io import available_cpus

    grids = torch.tensor([(1, 64, 64)] * 11)

    def prepare() -> None:
        get_vision_cu_seqlens(grids)
        get_vision_position_ids(grids, 2)
        get_vision_interpolation_indices_and_weights(grids, 48, mode="bilinear",
                                                     align_corners=True, spatial_merge_size=2)

    cpus = available_cpus()
    print(f"the ViT's host work for 11 images of 64x64 patches, torch {torch.__version__}, "
          f"{cpus} CPUs; median (max) of {repeats}")
    for busy in (0, cpus):
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    for _ in range(busy)]
        try:
            time.sleep(0.5)
            for threads in sorted({1, cpus}):
                torch.set_num_threads(threads)
                for _ in range(3):
                    prepare()
                took = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    prepare()
                    took.append(time.perf_counter() - start)
                print(f"{threads:>2} threads, {busy} busy processes: "
                      f"{statistics.median(took) * 1e3:7.1f} ms ({max(took) * 1e3:.1f})")
        finally:
            for spinner in spinners:
                spinner.kill()
                spinner.wait()


if __name__ == "__main__":
    main()
