"""What ``vlmshard simulate`` computes: a plan's epoch on a simulated cluster, the packing
strategies and OmniBal's three levers side by side, and the simulator checked against a
measured run."""

from __future__ import annotations

import os
from dataclasses import asdict

import numpy as np

from vlmshard.model_sizes import PRESETS, bytes_per_param, layer_work
from vlmshard.train.partition import Partition, PartitionError

from .config import SimulateConfig
from .model import (GPUS, LayerRates, StageModel, pipeline_times, replica_micro_batches,
                    search_for, simulate)

# OmniBal (ICML 2025), Table "ablation", InternVL-Chat-1.5 (6B + 20B), A100 GPU-days.
OMNIBAL_GPU_DAYS = {"baseline": 61.8, "+ data balance": 51.9, "+ model balance": 29.0,
                    "+ memory balance": 21.3}
STRATEGIES = ("random", "lengthgroup", "isf", "balanced")


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
                               flops_per_s=self.flops_per_s,
                               bytes_per_param=bytes_per_param(
                                   "bf16", self.dp if self.cfg.zero else 1, self.cfg.grad_accum),
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
    from vlmshard.packing.config import PADDED
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
    from vlmshard.packing.config import PackConfig
    from vlmshard.packing.plan import choose_caps, pack_epoch

    params = info["params"]
    cfg = PackConfig(stats=info["run"].get("stats", ""), dp=params["dp"], out="", algo=algo,
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

    from vlmshard.train.train_log import read_log

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
