"""What costing attention by layer kind does to a plan: Qwen3.5 (three of four layers linear
attention) and Gemma 3 (five of six layers in a 1024-token window).

    python benchmarks/layer_kinds_bench.py             # about 2 minutes on 2 vCPUs

For each model (its preset's analytic FLOPs, ``vlmshard.model_sizes``) and each synthetic data
mix of ``tests/length_mixes.py`` (20,000 samples; a 256-token image unit: one Gemma 3 image or
crop, 256 merged patches of Qwen3.5), ``balanced`` packs the samples twice for R=8 ranks, M=1:

- **by kind**: the cost model this code derives (only attention layers have the quadratic term;
  Gemma 3's local layers charge 1024·(2·len − 1024) past their window, where full causal
  attention is len²);
- **all attention**: the same sizes costed as if every layer were full softmax attention (what a
  FLOPs model without layer kinds charges).

Both plans are then measured under the by-kind cost, which is the model's real work:
``step_efficiency`` (useful work over what the ranks spend, the headline figure), the spread of
the quadratic work across ranks (``attn_dist_ratio``) and the caps each chose; and per mix, the
share of the model's work that is attention's quadratic term under each cost model (what the
metrics, report and simulator would attribute to it). Deterministic (seed 0); prints Markdown,
``--json`` also writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from dataclasses import replace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))

from length_mixes import SYNTHETIC, mix  # noqa: E402

from vlmshard.families import presets  # noqa: E402
from vlmshard.packing.batches import Lengths  # noqa: E402
from vlmshard.packing.config import PackConfig  # noqa: E402
from vlmshard.packing.cost import CostModel  # noqa: E402
from vlmshard.packing.metrics import measure  # noqa: E402
from vlmshard.packing.plan import choose_caps, pack_epoch  # noqa: E402

MODELS = {"qwen3.5-9b": 256, "gemma-3-4b": 1}  # ViT units per 256-token image unit
RANKS, MICRO, SAMPLES = 8, 1, 20_000


def all_attention(name: str) -> CostModel:
    """The preset's sizes with every LLM layer costed as full softmax attention."""
    model = presets()[name]
    llm = replace(model.llm, linear_layers=(), sliding_layers=(), sliding_window=0)
    return CostModel.from_sizes(replace(model, llm=llm))


def lengths_for(name: str, units: int) -> Lengths:
    base = mix(name, SAMPLES, seed=0)
    return Lengths(base.tiles * units, base.tokens, base.source, base.sources)


def attention_share(lengths: Lengths, cost: CostModel) -> float:
    """The quadratic term's share of the whole data's work under ``cost``."""
    quadratic = cost.b * cost.squares(lengths.tokens).sum()
    return float(quadratic / (cost.a_v * lengths.tiles.sum() + cost.a_t * lengths.tokens.sum()
                              + quadratic))


def plan(lengths: Lengths, packed_with: CostModel, truth: CostModel) -> dict:
    cfg = PackConfig(stats="-", dp=RANKS, out="-", micro_batches=MICRO, algo="balanced")
    caps, _, _ = choose_caps(cfg, lengths, packed_with)
    packing = pack_epoch(cfg, lengths, caps, packed_with, seed=0)
    metrics = measure(lengths, packing, qv=caps.qv, qt=caps.qt, cost=truth, padded=False,
                      dp=RANKS, pack_seconds=0.0)
    return {"qv": caps.qv, "qt": caps.qt, "step_efficiency": metrics.step_efficiency,
            "attn_dist_ratio": metrics.attn_dist_ratio, "steps": metrics.steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the numbers here")
    args = parser.parse_args()
    results = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "rows": []}
    print("| model | mix | packed with | Qt | step_efficiency (by-kind cost) | attn dist | "
          "attention's share of the work under it |")
    print("|---|---|---|---:|---:|---:|---:|")
    for model, units in MODELS.items():
        truth, naive = CostModel.from_sizes(presets()[model]), all_attention(model)
        for name in SYNTHETIC:
            lengths = lengths_for(name, units)
            for label, cost in (("by kind", truth), ("all attention", naive)):
                row = {"model": model, "mix": name, "packed_with": label,
                       **plan(lengths, cost, truth),
                       "attention_share": attention_share(lengths, cost)}
                results["rows"].append(row)
                print(f"| {model} | {name} | {label} | {row['qt']:,} | "
                      f"{row['step_efficiency']:.4f} | {row['attn_dist_ratio']:.4f} | "
                      f"{row['attention_share']:.1%} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
