"""The memory model against what is measured: a GPU's own reading of a real run, step by step,
and every layer kind of every family against the bytes autograd saves.

    python benchmarks/memory_bench.py                 # the H100 run in ../shared/measurements
    python benchmarks/memory_bench.py --run DIR       # another gpu_bench.py run folder
    python benchmarks/memory_bench.py --layer-kinds   # also the layer kinds, about 2 minutes

A run folder holds what ``benchmarks/gpu_bench.py`` wrote on the device: ``gpu.json`` (the model
it trained: Qwen3-VL-2B's sizes, its head tied or not, unless it names another; the recompute
each plan ran, whole and selective, and what its kernels keep for backward) and the plans'
``*-train_log.jsonl``
(per step and rank the allocator's peak and each micro-batch's tiles and tokens), in the folder
or its ``logs/``. For every step after the first (the first has no Adam moments yet: torch
makes them at the first optimizer step) the model's peak for one pipeline stage (PP=1) holding
the step's largest micro-batch is ``vlmshard.partition.predicted_stage_peak``: parameters with
their gradients and optimizer states (``model_sizes.bytes_per_param``), the activations the
recompute plan keeps, the largest recomputed layer rebuilt and the largest transient
(``model_sizes.layer_work``, keeping what the run's kernels keep: ``run_saves``). Prints a
table per plan and the median and worst ratio of predicted to measured; ``--json`` also writes
them.

``--layer-kinds``: each family's tiny test model (``tests/hf_reference.py``) on one micro-batch of
the tests' rows, profiled layer by layer in bf16 on this CPU (``vlmshard train profile``'s
``profile_layers``): per layer kind the bytes autograd saved for backward (its saved-tensor
hooks) beside the analytic model's, and the transient beyond them (torch's memory tracker)
beside the analytic bound.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from vlmshard.model_sizes import Saves, CostTerms, bytes_per_param, layer_work  # noqa: E402
from vlmshard.partition import predicted_stage_peak  # noqa: E402

DEFAULT_RUN = os.path.join(os.path.dirname(REPO), "shared", "measurements", "h100-2026-11-26")


def qwen3_vl_2b(tied: bool):
    """Qwen3-VL-2B's sizes as ``gpu_bench.py`` builds its model (``QWEN3_VL_2B``; the LM head
    tied to the token embedding or not, as the run read had it), read by the
    family as a folder's config.json is."""
    from transformers import Qwen3VLConfig

    from benchmarks.gpu_bench import QWEN3_VL_2B
    from vlmshard.families import model_sizes

    config = Qwen3VLConfig(text_config=QWEN3_VL_2B["text_sizes"],
                           vision_config=QWEN3_VL_2B["vision_sizes"],
                           tie_word_embeddings=tied).to_dict()
    return model_sizes(config, "qwen3-vl-2b")


def run_saves(gpu: dict, plan: dict) -> Saves:
    """What a run's kernels kept for backward (``model_sizes.Saves``): as its JSON line records
    them, or, for a run from before it did, read from its kernels (none recorded: the ViT
    attended image by image, no Liger), attention backend and torch (K/V heads repeated for
    torch's varlen kernel before 2.12). Qwen3-VL's ViT has no module Liger swaps."""
    if "saves" in plan:
        return Saves(**plan["saves"])
    kernels = plan.get("kernels", {})
    varlen = gpu.get("attention") == "varlen"
    major, minor = (int(n) for n in gpu["torch"].split(".")[:2])
    return Saves(vit_one_call=varlen and kernels.get("vit_varlen", False)
                 and not kernels.get("sdpa_cudnn", False),
                 liger_llm=kernels.get("liger", False) and "llm" not in (
                     kernels.get("compile_blocks") or ()),
                 kv_repeated=varlen and (major, minor) < (2, 12))


def step_rows(log: str, recompute: list[str], selective: list[str], sizes,
              saves: Saves) -> list[dict]:
    """Per step after the first: the measured peak and the model's, by part."""
    work = layer_work(sizes, saves)
    names = [w.name for w in work]
    again, partly = ([names.index("projector_merge" if n == "projector" else n) for n in layers]
                     for layers in (recompute, selective))
    param_bytes = bytes_per_param("bf16", dp=1)
    rows = []
    with open(log, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    for record in records[1:]:
        micro = record["data"][0]["micro_sizes"]
        largest = CostTerms(max(m["tiles"] for m in micro), max(m["tokens"] for m in micro))
        parts = predicted_stage_peak(work, again, largest, 1, param_bytes, partly)
        measured = max(r["peak_memory_bytes"] for r in record["ranks"])
        rows.append({"step": record["step"], "tiles": largest.tiles, "tokens": largest.tokens,
                     "measured": measured, "predicted": parts.pop("predicted_peak_bytes"),
                     **parts})
    return rows


def layer_kinds(work: str) -> dict:
    """Per family and layer kind: measured and analytic activation and transient bytes."""
    import torch

    sys.path.insert(0, os.path.join(REPO, "tests"))
    from hf_reference import FAMILIES, make_folder, make_shards

    from vlmshard.shards.loader import ShardDataset
    from vlmshard.train.hf_model import model_layers
    from vlmshard.train.profile import profile_layers

    table = {}
    for family in FAMILIES:
        root = Path(work) / family
        root.mkdir(parents=True, exist_ok=True)
        folder = make_folder(family, str(root / "model"))
        shards = make_shards(folder, root, target_samples=3, micro_batches=2)
        model = model_layers(folder)
        batches = list(ShardDataset(shards, pixel_dtype=torch.bfloat16))[:1]
        profile = profile_layers(model, batches, dtype=torch.bfloat16, repeats=1, warmup=0)
        kinds = table.setdefault(family, {})
        for d, cost, analytic in zip(model.defs, profile.layers, profile.analytic):
            kinds.setdefault(d.kind, {"activation": cost.activation_bytes,
                                      "analytic_activation": analytic["activation_bytes"],
                                      "transient": cost.transient_bytes,
                                      "analytic_transient": analytic["transient_bytes"]})
    print("\n| family | layer kind | saved for backward | analytic | ratio | transient | "
          "analytic bound |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for family, kinds in table.items():
        for kind, r in kinds.items():
            print(f"| {family} | {kind} | {r['activation']:,} | {r['analytic_activation']:,} | "
                  f"{r['analytic_activation'] / r['activation']:.3f} | {r['transient']:,} | "
                  f"{r['analytic_transient']:,} |")
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default=DEFAULT_RUN, help="a gpu_bench.py run folder")
    p.add_argument("--layer-kinds", action="store_true",
                   help="also profile every family's layer kinds on this CPU (bf16)")
    p.add_argument("--work", default=os.path.join(REPO, "build", "memory_bench"),
                   help="where --layer-kinds builds its tiny models and shards")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    with open(os.path.join(args.run, "gpu.json"), encoding="utf-8") as f:
        gpu = json.load(f)
    sizes = qwen3_vl_2b(gpu.get("tied_head", False))  # runs before it was recorded: untied
    result = {"run": os.path.abspath(args.run), "device": gpu["device"], "plans": {}}
    gib = 2 ** 30
    logs = sorted(glob.glob(os.path.join(args.run, "*-train_log.jsonl"))) + sorted(
        glob.glob(os.path.join(args.run, "logs", "*-train_log.jsonl")))
    for log in logs:
        plan = os.path.basename(log).removesuffix("-train_log.jsonl")
        described = os.path.join(args.run, f"{plan}-pipeline.json")
        if plan in gpu:
            run = gpu[plan]
        elif os.path.exists(described):  # a run the JSON line leaves out (out of memory)
            with open(described, encoding="utf-8") as f:
                stages = json.load(f)["stages"]
            run = {key: [n for s in stages for n in s.get(key, [])]
                   for key in ("recompute", "selective")}
        else:  # another call's log in the folder
            continue
        recompute, selective = run["recompute"], run.get("selective", [])
        rows = step_rows(log, recompute, selective, sizes, run_saves(gpu, run))
        ratios = [r["predicted"] / r["measured"] for r in rows]
        result["plans"][plan] = {"rows": rows, "median_ratio": statistics.median(ratios),
                                 "min_ratio": min(ratios), "max_ratio": max(ratios)}
        print(f"\n{plan} ({gpu['device']}, {len(recompute)} layers recomputed whole, "
              f"{len(selective)} selectively; kept as {run_saves(gpu, run)})")
        print("| step | largest micro-batch | measured GiB | predicted GiB | params | "
              "activations | rebuilt | transient | predicted / measured |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for r, ratio in zip(rows, ratios):
            print(f"| {r['step']} | {r['tiles']:,.0f} tiles, {r['tokens']:,.0f} tokens | "
                  f"{r['measured'] / gib:.2f} | {r['predicted'] / gib:.2f} | "
                  f"{r['params'] / gib:.2f} | {r['activations'] / gib:.2f} | "
                  f"{r['rebuilt'] / gib:.2f} | {r['transient'] / gib:.2f} | {ratio:.3f} |")
        print(f"predicted / measured: median {statistics.median(ratios):.3f}, "
              f"range {min(ratios):.3f} .. {max(ratios):.3f}")
    if args.layer_kinds:
        result["layer_kinds"] = layer_kinds(args.work)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
