"""``vlmshard simulate``: a plan's epoch on a simulated cluster, the packing strategies and
OmniBal's three levers side by side, and the simulator checked against a measured run."""

from __future__ import annotations

import argparse
from vlmshard.config import add_options, load_config

from .config import SimulateConfig

DESCRIPTION = """\
Simulates one epoch of PLAN_DIR on PP x DP GPUs: every data-parallel replica runs its
micro-batches of each step through a 1F1B pipeline whose stage times come from the model's
per-layer FLOPs for that micro-batch (tiles, tokens, squared lengths) at --mfu of the GPU's peak,
with the searched stage partition and per-stage recompute that fit the GPU's memory (ZeRO-1
optimizer states). The step waits for the slowest replica. Micro-batches are costed as the
trainer executes them in --compute-mode (default: the plan's): padding-free on their real tiles
and tokens, padded on all Qv tiles and Qt tokens (each packing's own caps) with attention over
the real samples. Reports time, GPU-days, the pipeline bubble fraction and the data-parallel
waiting fraction, then:

  strategies  the same samples packed random / lengthgroup / isf / balanced, each simulated
  levers      OmniBal's ablation: baseline (random data, DeepSpeed 'parameters' partition, full
              recompute) -> + data balance -> + model balance (searched partition) -> + memory
              balance (adaptive recompute), next to OmniBal's published A100 GPU-days

--train-log RUN/train_log.jsonl --profile PROFILE_DIR checks the simulator against a real run:
each logged step is re-simulated from its logged micro-batch sizes with the profile's measured
layer times and the run's own partition, and the error against the measured step time is
reported (PLAN_DIR is then optional)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_options(p, SimulateConfig)


def main(args: argparse.Namespace) -> int:
    from vlmshard.io import write_json_atomic
    from vlmshard.partition import PartitionError

    from .runs import run_simulate

    try:
        cfg = load_config(SimulateConfig, args)
        result = run_simulate(cfg)
    except (ValueError, OSError, KeyError, PartitionError) as e:
        raise SystemExit(f"vlmshard simulate: error: {e}") from None
    print(format_result(result))
    if cfg.json:
        write_json_atomic(cfg.json, result)
    return 0


def format_result(result: dict) -> str:
    from .runs import OMNIBAL_GPU_DAYS

    lines = []
    if "plan" in result:
        p = result["plan"]
        lines.append(f"{p['algorithm']} plan on {p['gpus']} x {p['gpu']} (pp {p['pp']}, dp "
                     f"{p['dp']}), {p['model']}, {p['compute_mode']} compute (Qv {p['qv']}, Qt "
                     f"{p['qt']}): {_row(p)}")
        lines.append(f"  partition {p['partition']['bounds']}, recomputed layers per stage "
                     f"{p['partition']['recompute']}, memory GiB {p['partition']['memory_gib']}")
    if "strategies" in result:
        base = result["strategies"]["random"].get("seconds")
        lines.append(f"\n{result['plan']['compute_mode']} compute, each packing at its own "
                     "caps Qv/Qt")
        lines.append(f"{'strategy (Qv/Qt)':<22} {'GPU-days':>9} {'bubble':>7} {'waiting':>8} "
                     f"{'speedup':>8}")
        for name, r in result["strategies"].items():
            lines.append(_table_row(f"{name} ({r['qv']}/{r['qt']})", r, base))
        lines.append(f"\n{'lever':<22} {'GPU-days':>9} {'bubble':>7} {'waiting':>8} "
                     f"{'speedup':>8}   OmniBal (A100 GPU-days, speedup)")
        base = result["levers"]["baseline"].get("seconds")
        for name, r in result["levers"].items():
            paper = OMNIBAL_GPU_DAYS[name]
            lines.append(f"{_table_row(name, r, base)}   {paper:>5.1f} "
                         f"{OMNIBAL_GPU_DAYS['baseline'] / paper:>5.2f}x")
    if "validation" in result:
        v = result["validation"]
        lines.append(f"\nsimulated against {v['steps']} measured steps: {v['predicted_s']:.2f} s "
                     f"predicted vs {v['measured_s']:.2f} s measured ({v['total_error']:+.1%}); "
                     f"median per-step error {v['median_step_error']:.1%}")
    return "\n".join(lines)


def _row(r: dict) -> str:
    return (f"{r['seconds'] / 3600:.2f} h, {r['gpu_days']:.4g} GPU-days, bubble "
            f"{r['bubble_fraction']:.1%}, waiting {r['waiting_fraction']:.1%}")


def _table_row(name: str, r: dict, base: float | None) -> str:
    if "error" in r:
        return f"{name:<22} does not fit: {r['error']}"
    speedup = f"{base / r['seconds']:.2f}x" if base else "-"
    return (f"{name:<22} {r['gpu_days']:>9.4g} {r['bubble_fraction']:>7.1%} "
            f"{r['waiting_fraction']:>8.1%} {speedup:>8}")

