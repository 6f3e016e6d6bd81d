"""The memory model against a GPU's own reading: each logged step of a real run's
``max_memory_allocated`` beside the peak the model predicts for that step.

    python benchmarks/memory_bench.py                 # the H100 run in ../shared/measurements
    python benchmarks/memory_bench.py --run DIR       # another gpu_bench.py run folder

A run folder holds what ``benchmarks/gpu_bench.py`` wrote on the device: ``gpu.json`` (the model
it trained: Qwen3-VL-2B's sizes unless it names another; the recompute each plan ran) and the
plans' ``*-train_log.jsonl`` (per step and rank the allocator's peak and each micro-batch's
tiles and tokens). For every step after the first (the first has no Adam moments yet: torch
makes them at the first optimizer step) the model's peak for one pipeline stage (PP=1) holding
the step's largest micro-batch is ``vlmshard.partition.stage_memory_parts``: parameters with
their gradients and optimizer states (``model_sizes.bytes_per_param``), the activations the
recompute plan keeps, the largest recomputed layer rebuilt and the largest transient
(``model_sizes.layer_work``). Prints a table per plan and the median and worst ratio of
predicted to measured; ``--json`` also writes them.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from vlmshard.model_sizes import Size, bytes_per_param, layer_work  # noqa: E402
from vlmshard.partition import analytic_layer_costs, stage_memory_parts  # noqa: E402

DEFAULT_RUN = os.path.join(os.path.dirname(REPO), "shared", "measurements", "h100-2026-11-26")


def qwen3_vl_2b():
    """Qwen3-VL-2B's sizes as ``gpu_bench.py`` builds its model (``QWEN3_VL_2B``), read by the
    family as a folder's config.json is."""
    from transformers import Qwen3VLConfig

    from benchmarks.gpu_bench import QWEN3_VL_2B
    from vlmshard.families import model_sizes

    config = Qwen3VLConfig(text_config=QWEN3_VL_2B["text_sizes"],
                           vision_config=QWEN3_VL_2B["vision_sizes"]).to_dict()
    return model_sizes(config, "qwen3-vl-2b")


def step_rows(log: str, recompute: list[str], sizes) -> list[dict]:
    """Per step after the first: the measured peak and the model's, by part."""
    work = layer_work(sizes)
    names = [w.name for w in work]
    again = [names.index("projector_merge" if n == "projector" else n) for n in recompute]
    param_bytes = bytes_per_param("bf16", dp=1)
    rows = []
    with open(log, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    for record in records[1:]:
        micro = record["data"][0]["micro_sizes"]
        largest = Size(max(m["tiles"] for m in micro), max(m["tokens"] for m in micro))
        costs = analytic_layer_costs(work, time_size=largest, memory_size=largest,
                                     flops_per_s=1.0, bytes_per_param=param_bytes)
        parts = stage_memory_parts(costs, 0, len(costs), 1, again)
        measured = max(r["peak_memory_bytes"] for r in record["ranks"])
        rows.append({"step": record["step"], "tiles": largest.tiles, "tokens": largest.tokens,
                     "measured": measured, "predicted": sum(parts.values()), **parts})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default=DEFAULT_RUN, help="a gpu_bench.py run folder")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    with open(os.path.join(args.run, "gpu.json"), encoding="utf-8") as f:
        gpu = json.load(f)
    sizes = qwen3_vl_2b()
    result = {"run": os.path.abspath(args.run), "device": gpu["device"], "plans": {}}
    gib = 2 ** 30
    for log in sorted(glob.glob(os.path.join(args.run, "*-train_log.jsonl"))):
        plan = os.path.basename(log).removesuffix("-train_log.jsonl")
        recompute = gpu[plan]["recompute"] if plan in gpu else None
        if recompute is None:  # a run the JSON line does not describe (it ran out of memory)
            with open(os.path.join(args.run, f"{plan}-pipeline.json"), encoding="utf-8") as f:
                recompute = [n for s in json.load(f)["stages"] for n in s["recompute"]]
        rows = step_rows(log, recompute, sizes)
        ratios = [r["predicted"] / r["measured"] for r in rows]
        result["plans"][plan] = {"rows": rows, "median_ratio": statistics.median(ratios),
                                 "min_ratio": min(ratios), "max_ratio": max(ratios)}
        print(f"\n{plan} ({gpu['device']}, {len(recompute)} layers recomputed)")
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
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
