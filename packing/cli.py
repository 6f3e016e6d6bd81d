"""``vlmshard pack``: the command-line face of ``packing.plan.run_pack``."""

from __future__ import annotations

import argparse
import json

from vlmshard.config import add_options, load_config

from .config import PackConfig

DESCRIPTION = """\
Reads the stats table (the preprocess output folder) or OmniBal length files (a JSON list of
{vit_num, token_num} or OmniBal's meta JSON naming several token_lengths files) and writes
OUT/plan.parquet (step, rank, micro, slot, sample_id: Contract 2) and OUT/plan.json (options,
caps, cost model, metrics, timings, unplaced samples with reasons).

Every step has DP x MICRO_BATCHES micro-batches (or VIRTUAL_RANKS x MICRO_BATCHES: shards planned
for V virtual ranks serve any real DP size that divides V). Each micro-batch holds at most Qv
ViT tiles and Qt LLM tokens. Algorithms:
  balanced     near-full on tiles and tokens, equal tiles, tokens, attention and cost on every
               rank at every step, data order kept random; Qv/Qt chosen from the data
  isf          OmniBal's Iterative Sampling and Filtering, with its Qv/Qt search when not given
  lengthgroup  LLaVA's length-grouped megabatches, TARGET_SAMPLES per micro-batch, padded
  random       TARGET_SAMPLES per micro-batch in random order, padded

The same input, options and seed give a byte-identical plan.parquet; epoch e uses SEED + e."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_options(p, PackConfig)
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")


def main(args: argparse.Namespace) -> int:
    from .metrics import format_metrics
    from .plan import run_pack

    as_json = args.__dict__.pop("json")
    try:
        result = run_pack(load_config(PackConfig, args))
    except (ValueError, FileNotFoundError) as e:  # ConfigError and StatsError are ValueErrors
        raise SystemExit(f"vlmshard pack: error: {e}") from None
    report = result.metrics.report()
    if as_json:
        print(json.dumps(report, indent=1))
    else:
        print(format_metrics(report))
        if result.unplaced_by_reason:
            print("unplaced: " + ", ".join(f"{n} {r}" for r, n in
                                           result.unplaced_by_reason.items()))
        print(f"plan written to {result.out}/plan.parquet")
    return 0
