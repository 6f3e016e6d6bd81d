"""What ``vlmshard simulate`` computes: a plan's epoch on a simulated cluster, the packing
strategies and OmniBal's three levers side by side, and the simulator checked against a
measured run."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import numpy as np

from vlmshard.errors import ConfigError, InputError
from vlmshard.hardware import GPUS
from vlmshard.io import file_in, folder_of, write_json_atomic
from vlmshard.run_log import LOG_NAME
from vlmshard.families import presets
from vlmshard.model_sizes import (
    bytes_per_param,
    layer_work,
    weight_bytes_per_param,
    with_adapters,
)
from vlmshard.recipe import Recipe, input_needs_grad
from vlmshard.partition import Partition, PartitionError
from vlmshard.stage import Result

from .config import SimulateConfig
from .cost_error import true_factors, true_sizes
from .model import (LayerRates, StageModel, in_patches, replica_micro_batches, search_for,
                    simulate)
from .replay import validate_against_log
from .runtime import STRATEGIES as RUNTIME
from .runtime import Links, rebalance

# OmniBal (ICML 2025), Table "ablation", InternVL-Chat-1.5 (6B + 20B), A100 GPU-days.
OMNIBAL_GPU_DAYS = {"baseline": 61.8, "+ data balance": 51.9, "+ model balance": 29.0,
                    "+ memory balance": 21.3}
STRATEGIES = ("random", "lengthgroup", "isf", "balanced")


class SimulateResult(dict, Result):
    """The simulation as a JSON mapping (``config``, ``plan``, ``strategies``, ``levers``,
    ``validation``), which is also how its callers read it."""

    def summary(self) -> str:
        return self.text().lstrip("\n").splitlines()[0]

    def text(self) -> str:
        return format_result(self)

    def to_json(self) -> dict[str, Any]:
        return dict(self)


def run_simulate(cfg: SimulateConfig) -> SimulateResult:
    """The simulation of ``cfg.plan`` (with its comparisons) and/or the check against a run;
    also written to ``cfg.out_json`` when given."""
    result = SimulateResult(config=asdict(cfg))
    try:
        if cfg.plan:
            result.update(simulate_plan(cfg))
        if cfg.train_log:  # a run's folder for its log, a profile's profile.json for its folder
            result["validation"] = validate_against_log(
                file_in(cfg.train_log, LOG_NAME, "--train-log"),
                cfg.profile and folder_of(cfg.profile, "profile.json", "--profile"))
    except KeyError as e:  # a plan.json or run files of an older vlmshard
        raise InputError(f"{cfg.plan or cfg.train_log} lacks {e}: make it again with this "
                         "vlmshard") from e
    if cfg.out_json:
        write_json_atomic(cfg.out_json, result)
    return result


class _Cluster:
    """The model, GPU and parallel layout every plan of one ``simulate`` call runs on."""

    def __init__(self, cfg: SimulateConfig, ranks: int, micro: int,
                 recipe: Recipe = Recipe()) -> None:
        self.cfg, self.ranks, self.micro = cfg, ranks, micro
        self.dp = cfg.dp or ranks
        self.model = model = presets()[cfg.model]
        self.work = with_adapters(layer_work(model), model, recipe.lora)
        # each layer as the plan's recipe runs it: a frozen part's backward, or none
        self.modes = recipe.modes(model.layer_names(), tied=model.llm.tied_embeddings)
        self.gpu = GPUS[cfg.gpu]
        self.flops_per_s = self.gpu.peak_flops * cfg.mfu
        self.rates = LayerRates.from_work(self.work, self.flops_per_s, self.modes)

    def run(self, sizes: np.ndarray, wire: np.ndarray, true: np.ndarray,
            method: str = "search", full_recompute: bool = False) -> dict:
        """A packing's executed micro-batch ``sizes`` [micro-batches, 5] whose stages exchange
        ``wire``-sized tensors (``_wire``), on the cluster: partitioned for ``sizes``, timed at
        their ``true`` work (``cost_error``)."""
        batches = replica_micro_batches(true, self.ranks, self.micro, self.dp,
                                        self.cfg.micro_batches)
        return self.run_batches(batches, sizes, wire, method=method,
                                full_recompute=full_recompute)

    def slots(self, n_micro: int) -> np.ndarray:
        """[steps, D, M]: which of a packing's micro-batches each replica runs in each slot."""
        index = np.arange(n_micro, dtype=np.float64)[:, None]
        return replica_micro_batches(index, self.ranks, self.micro, self.dp,
                                     self.cfg.micro_batches)[..., 0].astype(np.int64)

    def run_batches(self, batches: np.ndarray, sizes: np.ndarray, wire: np.ndarray,
                    method: str = "search", full_recompute: bool = False) -> dict:
        """Each replica's micro-batches ``batches`` [steps, D, M, C] on the cluster, its stages
        partitioned for the micro-batch ``sizes``."""
        partition = search_for(self.work, sizes, self.cfg.pp, self.gpu,
                               flops_per_s=self.flops_per_s,
                               bytes_per_param=bytes_per_param(
                                   "bf16", self.dp if self.cfg.zero else 1, self.cfg.grad_accum,
                                   zero=1),
                               full_recompute=full_recompute, method=method, modes=self.modes,
                               frozen_bytes_per_param=weight_bytes_per_param("bf16"))
        input_grads = [input_needs_grad(self.modes, i) for i in range(len(self.modes))]
        sim = simulate(batches, StageModel.build(self.rates, partition,
                                                 self.gpu.link_bytes_per_s, input_grads), wire)
        return {**sim.summary(), "partition": _describe(partition, self.work)}

    def try_run(self, sizes: np.ndarray, wire: np.ndarray, true: np.ndarray, **kwargs) -> dict:
        try:
            return self.run(sizes, wire, true, **kwargs)
        except PartitionError as e:
            return {"error": str(e)}

    def rebalanced(self, loaded, lengths, strategy: str, mode: str, cost, caps,
                   factors: np.ndarray) -> dict:
        """The micro-batches as ``loaded`` (a packing), dealt out again at every step by the
        runtime ``strategy`` (``runtime.STRATEGIES``), its exchange and planning added to the
        step; the samples' work really ``factors`` times the model's."""
        from vlmshard.packing.metrics import executed_sizes

        re = rebalance(self.slots(loaded.n_micro), loaded.items, loaded.offsets, lengths,
                       cost, RUNTIME[strategy], Links.of(self.model, self.gpu), factors)
        flat, true = (in_patches(executed_sizes(x.reshape(-1, x.shape[-1]), qv=caps.qv,
                                                qt=caps.qt, mode=mode),
                                 self.model.patches_per_tile) for x in (re.batches, re.true))
        try:
            run = self.run_batches(true.reshape(re.batches.shape), flat, _wire(caps.qv, caps.qt))
        except PartitionError as e:
            return {"error": str(e)}
        compute = run["seconds"]
        seconds = compute + float(re.exchange_s.sum() + re.planning_s.sum())
        return {**run, "seconds": seconds, "gpu_days": run["gpu_days"] * seconds / compute,
                "exchange_share": float(re.exchange_s.sum()) / seconds,
                "planning_share": float(re.planning_s.sum()) / seconds,
                "moved_share": re.moved_share}


def simulate_plan(cfg: SimulateConfig) -> dict:
    """The plan, and (``cfg.compare``) the strategies and levers, each costed on what the
    trainer executes in the compute mode: a padded trainer's work and activations are at the
    packing's own caps, so low-fill packings pay for their padding."""
    from vlmshard.packing.cost import CostModel
    from vlmshard.packing.plan import load_plan, repack

    info, packing, lengths = load_plan(cfg.plan)
    mode = cfg.compute_mode or info["params"].get("compute_mode", "padding-free")
    factors = true_factors(cfg.cost_error, len(lengths))
    if mode == "padded" and (factors != 1).any():
        raise ConfigError("cost_error is modelled for padding-free compute only (a padded "
                          "micro-batch's padding has no sample to take a factor from)")
    cluster = _Cluster(cfg, packing.ranks, packing.micro_batches,
                       Recipe.from_params(info["params"]))
    plan_caps = {"qv": info["metrics"]["qv"], "qt": info["metrics"]["qt"]}
    own, own_true = _executed(lengths, packing, info["algorithm"], mode, factors,
                              cluster.model.patches_per_tile, **plan_caps)
    out = {"plan": {"algorithm": info["algorithm"], "compute_mode": mode, "dp": cluster.dp,
                    "pp": cfg.pp, "gpus": cluster.dp * cfg.pp, "gpu": cluster.gpu.name,
                    "model": cfg.model, **plan_caps,
                    **cluster.run(own, _wire(**plan_caps), own_true)}}
    if not cfg.compare:
        return out
    runs, out["strategies"], repacked = {}, {}, {}  # algo -> (executed sizes, wire, true)
    for algo in STRATEGIES:
        repacked[algo] = repack(info, lengths, algo, mode)
        caps = repacked[algo].caps
        sizes, true = _executed(lengths, repacked[algo].packing, algo, mode, factors,
                                cluster.model.patches_per_tile, qv=caps.qv, qt=caps.qt)
        runs[algo] = (sizes, _wire(caps.qv, caps.qt), true)
        out["strategies"][algo] = {"qv": caps.qv, "qt": caps.qt, **cluster.try_run(*runs[algo])}
    loaded = repacked["random"]  # what a runtime balancer starts from: micro-batches as loaded
    for name in RUNTIME:
        out["strategies"][name] = {
            "qv": loaded.caps.qv, "qt": loaded.caps.qt,
            **cluster.rebalanced(loaded.packing, lengths, name, mode,
                                 CostModel(**info["cost_model"]), loaded.caps, factors)}
    out["levers"] = {
        "baseline": cluster.try_run(*runs["random"], method="parameters", full_recompute=True),
        "+ data balance": cluster.try_run(*runs["balanced"], method="parameters",
                                          full_recompute=True),
        "+ model balance": cluster.try_run(*runs["balanced"], full_recompute=True),
        "+ memory balance": cluster.try_run(*runs["balanced"]),
    }
    return out


def _wire(qv: int, qt: int) -> np.ndarray:
    """What the stages exchange for every micro-batch in either mode: tensors of the caps'
    shapes (a pipeline sends static shapes; only the layers inside a stage skip padding)."""
    return np.array([qv, qt, 0.0])


def _executed(lengths, packing, algo: str, mode: str, factors: np.ndarray,
              patches_per_tile: int, *, qv: int, qt: int) -> tuple[np.ndarray, np.ndarray]:
    """[micro-batches, 5] twice: the tiles, tokens, Σseq_len², supervised tokens and Σ P² over
    ViT units (``in_patches``) the trainer computes on for each micro-batch of ``packing`` (made
    by ``algo``, under caps ``qv``, ``qt``) in ``mode``, as modelled and as the samples' true
    ``factors`` make them."""
    from vlmshard.packing.config import PADDED
    from vlmshard.packing.metrics import executed_sizes, micro_batch_sizes

    padded = algo in PADDED
    return tuple(in_patches(executed_sizes(s, qv=qv, qt=qt, mode=mode), patches_per_tile)
                 for s in (
        micro_batch_sizes(lengths, packing, padded),
        true_sizes(lengths, packing, padded, factors)))


def _describe(partition: Partition, work) -> dict:
    return {"bounds": partition.bounds,
            "recompute": [len(s.recompute) for s in partition.stages],
            "selective": [len(s.selective) for s in partition.stages],
            "stage_layers": [s.end - s.first for s in partition.stages],
            "memory_gib": [round(s.memory_bytes / 2 ** 30, 1) for s in partition.stages]}


# ---------------------------------------------------------------------------------------------
# As the terminal shows it


def format_result(result: dict) -> str:
    """The simulation as the terminal shows it: the plan's line, then the tables."""
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
                     f"{'speedup':>8} {'exchange':>9} {'planning':>9}")
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
    runtime = (f" {r['exchange_share']:>9.1%} {r['planning_share']:>9.2%}"
               if "exchange_share" in r else "")
    return (f"{name:<22} {r['gpu_days']:>9.4g} {r['bubble_fraction']:>7.1%} "
            f"{r['waiting_fraction']:>8.1%} {speedup:>8}{runtime}")

