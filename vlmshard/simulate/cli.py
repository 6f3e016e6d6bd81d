"""``vlmshard simulate``: a plan's epoch on a simulated cluster, the packing strategies and
OmniBal's three levers side by side, and the simulator checked against a measured run."""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass

import numpy as np

from vlmshard.model_sizes import PRESETS, layer_work
from vlmshard.train.partition import Partition, PartitionError
from .model import (GPUS, LayerRates, StageModel, pipeline_times, replica_micro_batches,
                       search_for, simulate)

HELP = "simulate a plan's epoch at cluster scale: time, GPU-days, bubbles, waiting"
DESCRIPTION = """\
Simulates one epoch of PLAN_DIR on PP x DP GPUs: every data-parallel replica runs its
micro-batches of each step through a 1F1B pipeline whose stage times come from the model's
per-layer FLOPs for that micro-batch (tiles, tokens, squared lengths) at --mfu of the GPU's peak,
with the searched stage partition and per-stage recompute that fit the GPU's memory (ZeRO-1
optimizer states). The step waits for the slowest replica. Reports time, GPU-days, the pipeline
bubble fraction and the data-parallel waiting fraction, then:

  strategies  the same samples packed random / lengthgroup / isf / balanced, each simulated
  levers      OmniBal's ablation: baseline (random data, DeepSpeed 'parameters' partition, full
              recompute) -> + data balance -> + model balance (searched partition) -> + memory
              balance (adaptive recompute), next to OmniBal's published A100 GPU-days

--train-log RUN/train_log.jsonl --profile PROFILE_DIR checks the simulator against a real run:
each logged step is re-simulated from its logged micro-batch sizes with the profile's measured
layer times and the run's own partition, and the error against the measured step time is
reported (PLAN_DIR is then optional)."""

# OmniBal (ICML 2025), Table "ablation", InternVL-Chat-1.5 (6B + 20B), A100 GPU-days.
OMNIBAL_GPU_DAYS = {"baseline": 61.8, "+ data balance": 51.9, "+ model balance": 29.0,
                    "+ memory balance": 21.3}
STRATEGIES = ("random", "lengthgroup", "isf", "balanced")


@dataclass
class SimulateConfig:
    """Options of ``vlmshard simulate`` (CLI flags and YAML keys have these names)."""

    plan: str | None = None
    model: str = "internvl-chat-1.5"
    gpu: str = "a100"
    pp: int = 4
    dp: int | None = None  # default: the plan's ranks
    micro_batches: int | None = None  # per replica per step; default: the plan's
    mfu: float = 0.45  # sustained share of peak FLOPs
    zero: int = 1  # DeepSpeed pipelines support ZeRO stage 0 or 1
    compare: bool = True  # strategies and levers
    train_log: str | None = None
    profile: str | None = None
    json: str | None = None

    def validate(self) -> None:
        if self.model not in PRESETS:
            raise ValueError(f"unknown --model {self.model!r}; known: {', '.join(PRESETS)}")
        if self.gpu not in GPUS:
            raise ValueError(f"unknown --gpu {self.gpu!r}; known: {', '.join(GPUS)}")
        if self.pp < 1 or (self.dp is not None and self.dp < 1):
            raise ValueError("--pp and --dp must be at least 1")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"--mfu must be in (0, 1], got {self.mfu}")
        if self.zero not in (0, 1):
            raise ValueError("--zero must be 0 or 1 (DeepSpeed pipelines support no more)")
        if bool(self.train_log) != bool(self.profile):
            raise ValueError("--train-log needs --profile (the measured layer times), and back")
        if not self.plan and not self.train_log:
            raise ValueError("give a PLAN_DIR, or --train-log and --profile to validate")


def run_simulate(cfg: SimulateConfig) -> dict:
    """The simulation of ``cfg.plan`` (with its comparisons) and/or the check against a run."""
    cfg.validate()
    result: dict = {"config": asdict(cfg)}
    if cfg.plan:
        result.update(simulate_plan(cfg))
    if cfg.train_log:
        result["validation"] = validate_against_log(cfg.train_log, cfg.profile)
    return result


class _Cluster:
    """The model, GPU and parallel layout every plan of one ``simulate`` call runs on."""

    def __init__(self, cfg: SimulateConfig, ranks: int, micro: int) -> None:
        self.cfg, self.ranks, self.micro = cfg, ranks, micro
        self.dp = cfg.dp or ranks
        self.work = layer_work(PRESETS[cfg.model])
        self.gpu = GPUS[cfg.gpu]
        self.flops_per_s = self.gpu.peak_flops * cfg.mfu
        self.rates = LayerRates.from_work(self.work, self.flops_per_s)

    def run(self, sizes: np.ndarray, method: str = "search",
            full_recompute: bool = False) -> dict:
        partition = search_for(self.work, sizes, self.cfg.pp, self.gpu,
                               flops_per_s=self.flops_per_s, dp=self.dp, zero=self.cfg.zero,
                               full_recompute=full_recompute, method=method)
        batches = replica_micro_batches(sizes, self.ranks, self.micro, self.dp,
                                        self.cfg.micro_batches)
        sim = simulate(batches, StageModel.build(self.rates, partition,
                                                 self.gpu.link_bytes_per_s))
        return {**sim.summary(), "partition": _describe(partition, self.work)}

    def try_run(self, sizes: np.ndarray, **kwargs) -> dict:
        try:
            return self.run(sizes, **kwargs)
        except PartitionError as e:
            return {"error": str(e)}


def simulate_plan(cfg: SimulateConfig) -> dict:
    from vlmshard.packing.algorithms import PADDED
    from vlmshard.packing.metrics import micro_batch_sizes
    from vlmshard.packing.plan import load_plan

    info, packing, lengths = load_plan(cfg.plan)
    cluster = _Cluster(cfg, packing.ranks, packing.micro_batches)
    padded = info["algorithm"] in PADDED
    out = {"plan": {"algorithm": info["algorithm"], "dp": cluster.dp, "pp": cfg.pp,
                    "gpus": cluster.dp * cfg.pp, "gpu": cluster.gpu.name, "model": cfg.model,
                    **cluster.run(micro_batch_sizes(lengths, packing, padded))}}
    if not cfg.compare:
        return out
    sizes = {algo: micro_batch_sizes(lengths, repack(info, lengths, algo), algo in PADDED)
             for algo in STRATEGIES}
    out["strategies"] = {algo: cluster.try_run(s) for algo, s in sizes.items()}
    out["levers"] = {
        "baseline": cluster.try_run(sizes["random"], method="parameters", full_recompute=True),
        "+ data balance": cluster.try_run(sizes["balanced"], method="parameters",
                                          full_recompute=True),
        "+ model balance": cluster.try_run(sizes["balanced"], full_recompute=True),
        "+ memory balance": cluster.try_run(sizes["balanced"]),
    }
    return out


def repack(info: dict, lengths, algo: str):
    """The plan's samples packed again with ``algo`` (same ranks, micro-batches, seed, cost
    model; the caps each algorithm chooses for itself)."""
    from vlmshard.packing.cost import CostModel
    from vlmshard.packing.plan import PackConfig, choose_caps, pack_epoch

    params = info["params"]
    cfg = PackConfig(stats=params["stats"], dp=params["dp"], out="", algo=algo,
                     micro_batches=params["micro_batches"],
                     virtual_ranks=params["virtual_ranks"],
                     target_samples=params["target_samples"], seed=params["seed"])
    cost = CostModel(**info["cost_model"])
    caps, _, _ = choose_caps(cfg, lengths, cost)
    return pack_epoch(cfg, lengths, caps, cost, seed=cfg.seed)


def validate_against_log(train_log: str, profile_dir: str) -> dict:
    """Each logged step re-simulated with the profile's measured layer times and the run's
    partition (its ``train_config.json``), against the measured step time. The first step
    (warm-up) is left out."""
    from vlmshard.io import read_json

    from vlmshard.train.launcher import read_log

    records = read_log(train_log)[1:]
    if not records:
        raise ValueError(f"{train_log}: needs at least two steps (the first is warm-up)")
    config = read_json(os.path.join(os.path.dirname(train_log), "train_config.json"))
    profile = read_json(os.path.join(profile_dir, "profile.json"))
    rates = LayerRates.from_profile(profile, read_json(os.path.join(profile_dir,
                                                                    "cost_model.json")))
    partition = _run_partition(config, profile)
    stages = StageModel.build(rates, partition, float("inf"))  # one machine: no link to cross
    batches = np.array([[[[m["tiles"], m["tokens"], m["squares"]] for m in d["micro_sizes"]]
                         for d in r["data"]] for r in records], dtype=np.float64)
    steps, dp, micro, _ = batches.shape
    forward, backward = stages.times(batches.reshape(steps * dp, micro, 3))
    predicted = pipeline_times(forward, backward)[0].reshape(steps, dp).max(axis=1)
    measured = np.array([r["step_time_s"] for r in records])
    error = np.abs(predicted - measured) / measured
    return {"steps": int(steps), "predicted_s": float(predicted.sum()),
            "measured_s": float(measured.sum()),
            "total_error": float(predicted.sum() / measured.sum() - 1),
            "median_step_error": float(np.median(error)),
            "per_step": [{"step": r["step"], "predicted_s": float(p), "measured_s": float(m)}
                         for r, p, m in zip(records, predicted, measured)]}


def _run_partition(config: dict, profile: dict) -> Partition:
    """The stage bounds and recompute the run trained with (DeepSpeed's 'parameters' when it
    was given none, as the trainer does)."""
    from vlmshard.train.partition import LayerCost, Stage, deepspeed_bounds

    names = [lay["name"] for lay in profile["layers"]]
    bounds = config.get("bounds") or deepspeed_bounds(
        [LayerCost(**lay) for lay in profile["layers"]], config["pp"], "parameters")
    recompute = {names.index(n) for n in config.get("recompute") or []}
    return Partition(list(bounds), [Stage(a, b, sorted(i for i in recompute if a <= i < b))
                                    for a, b in zip(bounds[:-1], bounds[1:])])


def _describe(partition: Partition, work) -> dict:
    return {"bounds": partition.bounds,
            "recompute": [len(s.recompute) for s in partition.stages],
            "stage_layers": [s.end - s.first for s in partition.stages],
            "memory_gib": [round(s.memory_bytes / 2 ** 30, 1) for s in partition.stages]}


# ---------------------------------------------------------------------------------------------
# Command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    S = argparse.SUPPRESS
    p.add_argument("plan", nargs="?", default=S, metavar="PLAN_DIR", help="plan folder")
    p.add_argument("--config", help="YAML file with any of these options (flags override it), "
                                    "e.g. configs/simulate-omnibal.yaml")
    p.add_argument("--model", default=S, help=f"model preset ({', '.join(PRESETS)}; default "
                                              "internvl-chat-1.5)")
    p.add_argument("--gpu", default=S, help=f"{' or '.join(GPUS)} (default a100)")
    p.add_argument("--pp", type=int, default=S, help="pipeline stages (default 4)")
    p.add_argument("--dp", type=int, default=S,
                   help="data-parallel replicas (default: the plan's ranks; must divide them)")
    p.add_argument("--micro-batches", dest="micro_batches", type=int, default=S,
                   help="micro-batches per replica per step (default: the plan's)")
    p.add_argument("--mfu", type=float, default=S,
                   help="sustained fraction of peak FLOPs (default 0.45)")
    p.add_argument("--zero", type=int, default=S, help="ZeRO stage 0 or 1 (default 1)")
    p.add_argument("--no-compare", dest="compare", action="store_false", default=S,
                   help="only the plan itself: no strategies, no levers")
    p.add_argument("--train-log", dest="train_log", default=S,
                   help="train_log.jsonl of a run to check the simulator against")
    p.add_argument("--profile", default=S, help="the run's `vlmshard train profile` folder")
    p.add_argument("--json", default=S, help="also write the results as JSON here")


def main(args: argparse.Namespace) -> int:
    from vlmshard.config import load_config
    from vlmshard.io import write_json_atomic

    flags = {k: v for k, v in vars(args).items() if k != "config"}
    try:
        cfg = load_config(SimulateConfig, flags, args.config)
        result = run_simulate(cfg)
    except (ValueError, OSError, KeyError, PartitionError) as e:
        raise SystemExit(f"vlmshard simulate: error: {e}") from None
    print(format_result(result))
    if cfg.json:
        write_json_atomic(cfg.json, result)
    return 0


def format_result(result: dict) -> str:
    lines = []
    if "plan" in result:
        p = result["plan"]
        lines.append(f"{p['algorithm']} plan on {p['gpus']} x {p['gpu']} (pp {p['pp']}, dp "
                     f"{p['dp']}), {p['model']}: {_row(p)}")
        lines.append(f"  partition {p['partition']['bounds']}, recomputed layers per stage "
                     f"{p['partition']['recompute']}, memory GiB {p['partition']['memory_gib']}")
    if "strategies" in result:
        base = result["strategies"]["random"].get("seconds")
        lines.append(f"\n{'strategy':<18} {'GPU-days':>9} {'bubble':>7} {'waiting':>8} "
                     f"{'speedup':>8}")
        for name, r in result["strategies"].items():
            lines.append(_table_row(name, r, base))
        lines.append(f"\n{'lever':<18} {'GPU-days':>9} {'bubble':>7} {'waiting':>8} "
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
        return f"{name:<18} does not fit: {r['error']}"
    speedup = f"{base / r['seconds']:.2f}x" if base else "-"
    return (f"{name:<18} {r['gpu_days']:>9.4g} {r['bubble_fraction']:>7.1%} "
            f"{r['waiting_fraction']:>8.1%} {speedup:>8}")

