"""What balance saves at OmniBal's scale, by ``vlmshard simulate``.

    python benchmarks/simulate_bench.py                # about 4 minutes on 2 vCPUs

Data: OmniBal's released InternVL-1.2M length rows (ai2d + docvqa, 22,624 samples) resampled to
1,200,000 samples (seed 0, as ``pack_bench.py`` does), written as an OmniBal length file and
packed ``balanced`` for 32 data-parallel ranks, once per compute mode (``padding-free``: the
trainer computes on the real tiles and tokens; ``padded``: on the caps). Each plan is then
simulated in its own mode with ``configs/simulate-omnibal.yaml`` (InternVL-Chat-1.5, 6B + 20B,
on 4 × 32 A100s) and ``configs/simulate-h100.yaml``: the plan itself, the same samples packed
random / lengthgroup / isf / balanced, and OmniBal's three levers next to the paper's A100
GPU-days.

    python benchmarks/simulate_bench.py --recipes      # about 4 minutes on 2 vCPUs

``--recipes`` instead packs the same samples ``padding-free`` once per recipe users run (a full
fine-tune, the vision tower frozen, the vision tower frozen and LoRA rank 16 on the LLM beside
the trained projector, as InternVL's LoRA scripts) and simulates each plan on the same clusters
without the comparisons: the cost model, partition and recompute each recipe yields.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, REPO)

from pack_bench import DATA, real_lengths, resample  # noqa: E402

from vlmshard.packing.config import PackConfig  # noqa: E402
from vlmshard.packing.cost import COMPUTE_MODES  # noqa: E402
from vlmshard.packing.plan import run_pack  # noqa: E402
from vlmshard.simulate.config import SimulateConfig  # noqa: E402
from vlmshard.simulate.runs import format_result, run_simulate  # noqa: E402
from vlmshard.config import load_config  # noqa: E402
from vlmshard.io import write_json_atomic  # noqa: E402


# The recipes users run (vlmshard pack's --train and --lora-rank)
RECIPES = {"full": {},
           "vit-frozen": {"train": ["projector", "llm"]},
           "vit-frozen-lora16": {"train": ["projector", "llm"], "lora_rank": 16}}


def write_lengths(path: str, samples: int) -> None:
    """The resampled rows as one OmniBal length file."""
    lengths = resample(real_lengths(DATA), samples)
    rows = [{"vit_num": int(v), "token_num": int(t)}
            for v, t in zip(lengths.tiles, lengths.tokens)]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(rows, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default=os.path.join(REPO, "build", "bench", "simulate"))
    parser.add_argument("--samples", type=int, default=1_200_000)
    parser.add_argument("--dp", type=int, default=32)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--recipes", action="store_true",
                        help="a padding-free plan per recipe users run, each simulated alone")
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    lengths = os.path.join(args.work, "lengths.json")
    write_lengths(lengths, args.samples)
    results = {}
    plans = ({name: {"compute_mode": "padding-free", **recipe}
              for name, recipe in RECIPES.items()} if args.recipes
             else {mode: {"compute_mode": mode} for mode in COMPUTE_MODES})
    for label, options in plans.items():
        plan = os.path.join(args.work, f"plan-{label}")
        run_pack(PackConfig(stats=lengths, dp=args.dp, out=plan, model="internvl-chat-1.5",
                            **options))
        for name in ("simulate-omnibal", "simulate-h100"):
            config = os.path.join(REPO, "configs", f"{name}.yaml")
            values = {"plan": plan, "config": config, **({"compare": False}
                                                          if args.recipes else {})}
            cfg = load_config(SimulateConfig, values)
            results[f"{name} {label}"] = result = run_simulate(cfg)
            print(f"\n== vlmshard simulate {plan} --config configs/{name}.yaml  ({label})")
            print(format_result(result), flush=True)
    if args.json:
        write_json_atomic(args.json, results)



if __name__ == "__main__":
    main()
