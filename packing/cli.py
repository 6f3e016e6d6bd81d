"""``vlmshard pack``: the command-line face of ``packing.plan.run_pack``."""

from __future__ import annotations

import argparse
import json

from vlmshard.model_sizes import PRESETS
from vlmshard.config import load_config

from .algorithms import ALGORITHMS
from .cost import DEFAULT_MODEL
from .metrics import REPORT_KEYS
from .plan import PackConfig, run_pack
from .stats import StatsError

HELP = "pack samples into micro-batches balanced within and across data-parallel ranks"
DESCRIPTION = """\
Reads the stats table (the preprocess output folder) or OmniBal length files (a JSON list of
{vit_num, token_num} or OmniBal's meta JSON naming several token_lengths files) and writes
OUT/plan.parquet (step, rank, micro, slot, sample_id: Contract 2) and OUT/plan.json (options,
caps, cost model, metrics, timings, unplaced samples with reasons).

Every step has DP x MICRO_BATCHES micro-batches (or VIRTUAL_RANKS x MICRO_BATCHES: shards planned
for V virtual ranks serve any real DP size that divides V). Each micro-batch holds at most Qv
ViT tiles and Qt LLM tokens. Algorithms:
  balanced     (default) near-full on tiles and tokens, equal tiles, tokens, attention and cost
               on every rank at every step, data order kept random; Qv/Qt chosen from the data
  isf          OmniBal's Iterative Sampling and Filtering, with its Qv/Qt search when not given
  lengthgroup  LLaVA's length-grouped megabatches, TARGET_SAMPLES per micro-batch, padded
  random       TARGET_SAMPLES per micro-batch in random order, padded

The same input, options and seed give a byte-identical plan.parquet; epoch e uses SEED + e."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    S = argparse.SUPPRESS
    p.add_argument("--config", help="YAML file with any of these options (flags override it)")
    p.add_argument("--stats", default=S, help="preprocess output folder, a stats .parquet, or "
                                              "OmniBal length/meta .json (required)")
    p.add_argument("--dp", type=int, default=S, help="data-parallel ranks (required)")
    p.add_argument("--out", default=S, help="plan folder to write (required)")
    p.add_argument("--micro-batches", dest="micro_batches", type=int, default=S,
                   help="micro-batches per rank per step (default 1)")
    p.add_argument("--virtual-ranks", dest="virtual_ranks", type=int, default=S,
                   help="plan for this many ranks, a multiple of --dp (default: --dp)")
    p.add_argument("--algo", choices=ALGORITHMS, default=S, help="packing algorithm "
                                                                 "(default balanced)")
    p.add_argument("--qv", type=int, default=S, help="ViT tiles per micro-batch (with --qt)")
    p.add_argument("--qt", type=int, default=S, help="LLM tokens per micro-batch (with --qv)")
    p.add_argument("--target-samples", dest="target_samples", type=int, default=S,
                   help="mean samples per micro-batch that automatic caps aim at; samples per "
                        "micro-batch for random and lengthgroup (default 4)")
    p.add_argument("--seed", type=int, default=S, help="shuffle seed; epoch e uses seed+e "
                                                       "(default 0)")
    p.add_argument("--epochs", type=int, default=S, help="epochs to plan (default 1)")
    p.add_argument("--cost-model", dest="cost_model", default=S,
                   help="cost_model.json with a_v, a_t, b (from vlmshard train profile)")
    p.add_argument("--model", choices=sorted(PRESETS), default=S,
                   help=f"model whose FLOPs set the default cost model (default {DEFAULT_MODEL})")
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")


def main(args: argparse.Namespace) -> int:
    flags = {k: v for k, v in vars(args).items() if k not in ("config", "json")}
    try:
        cfg = load_config(PackConfig, flags, args.config)
        result = run_pack(cfg)
    except (StatsError, ValueError, FileNotFoundError) as e:
        raise SystemExit(f"vlmshard pack: error: {e}") from None
    report = result.metrics.report()
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(format_metrics(report))
        if result.unplaced_by_reason:
            print("unplaced: " + ", ".join(f"{n} {r}" for r, n in
                                           result.unplaced_by_reason.items()))
        print(f"plan written to {result.out}/plan.parquet")
    return 0


def format_value(value) -> str:
    """A metric as pack and report print it: floats to 4 decimals, counts as they are."""
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def format_metrics(report: dict) -> str:
    return "\n".join(f"{k:<16} {format_value(report[k])}" for k in REPORT_KEYS)
