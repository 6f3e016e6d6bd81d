"""A logged training run replayed by the simulator, step by step, next to what it measured.

Each logged step's micro-batch sizes go, per data-parallel replica, through the same 1F1B
recurrence ``simulate`` uses, with the run's own stage partition (``pipeline.json``, written by
the trainer). Stage times come from the profile's measured layer times (``profile``); or from the
analytic layer FLOPs of the model the run trained at the FLOP rate the profile measured for each
layer kind (``per_kind``: the sustained share of the peak per kind, not one assumed share); or
else from the analytic FLOPs alone: then the replay predicts shares of time (bubble, waiting),
which need no rate, and no seconds (no rate is fitted).

The log holds, per rank, its forward and backward seconds and ``pipeline_s``, from the step's
start to the end of its last backward; so the measured step splits as the simulated one does:

- a replica's makespan is its stages' longest ``pipeline_s`` (under 1F1B stage 0 ends last);
- a stage's bubble is 1 − its busy time (forward + backward) over its replica's makespan;
- DP waiting is 1 − Σ_d makespan_d / (D · max_d makespan_d), replicas idle until the slowest
  replica's pipeline ends (``simulate``'s ``waiting_fraction``);
- "other" is what follows the pipeline (gradient all-reduce, optimizer): measured, not modelled.

Sends between stages are not modelled either (the measured bubble holds them). The first logged
step (warm-up) is left out of every comparison.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from vlmshard.errors import ConfigError, InputError
from vlmshard.model_sizes import LayerWork, ModelConfig, trainer_layer_work
from vlmshard.partition import Partition, Stage
from vlmshard.run_log import PIPELINE_NAME, read_log, stage_bounds

from .model import (
    LayerRates,
    PipelineTimes,
    StageModel,
    logged_columns,
    pipeline_times,
    share,
)


@dataclass(frozen=True)
class Replay:
    """A run's logged steps (the warm-up left out): measured and replayed pipelines."""

    steps: np.ndarray  # [steps] logged step numbers
    step_time_s: np.ndarray  # [steps] measured
    measured: PipelineTimes | None  # seconds; None for a log written before pipeline_s
    predicted: PipelineTimes  # seconds with a profile, FLOPs without
    stage_layers: list[list[str]]
    basis: str  # where the stage times came from, in words
    in_seconds: bool  # whether ``predicted`` is in seconds


def replay_batches(records: list[dict], stages: StageModel) -> PipelineTimes:
    """The logged micro-batch sizes of each step and replica through the 1F1B stage model."""
    batches = np.array([[[logged_columns(m) for m in d["micro_sizes"]] for d in r["data"]]
                        for r in records], dtype=np.float64)
    steps, dp, micro, columns = batches.shape
    forward, backward = stages.times(batches.reshape(steps * dp, micro, columns))
    makespan, busy = pipeline_times(forward, backward)
    return PipelineTimes(makespan.reshape(steps, dp), busy.reshape(steps, dp, -1))


def measured_times(records: list[dict]) -> PipelineTimes | None:
    """Each replica's makespan and each stage's busy seconds as the ranks logged them; None
    when a rank logged no ``pipeline_s`` (a log older than it)."""
    if any("pipeline_s" not in r for record in records for r in record["ranks"]):
        return None
    dp = len(records[0]["data"])
    pp = 1 + max(r["stage"] for r in records[0]["ranks"])
    makespan, busy = np.zeros((len(records), dp)), np.zeros((len(records), dp, pp))
    for t, record in enumerate(records):
        for r in record["ranks"]:
            busy[t, r["dp_rank"], r["stage"]] = r["forward_s"] + r["backward_s"]
            makespan[t, r["dp_rank"]] = max(makespan[t, r["dp_rank"]], r["pipeline_s"])
    return PipelineTimes(makespan, busy)


def analytic_rates(names: list[str], model: ModelConfig, profile: dict | None = None,
                   modes: list[str] | None = None) -> LayerRates:
    """Per trainer layer ``names``, FLOPs per unit of each size (``COLUMNS``) from the analytic
    model (``model_sizes.trainer_layer_work``), each layer's backward as its mode ran it
    (``modes``: ``vlmshard.recipe``; default: all trained); with a ``profile`` of those layers,
    seconds at the FLOP rate it measured for each layer's kind (``sustained_flops_per_s``)."""
    work = _layer_work(names, model)
    if profile is None:
        return LayerRates.from_work(work, 1.0, modes)  # FLOPs: shares need no rate
    return LayerRates.sustained(work, profile, modes)


def _layer_work(names: list[str], model: ModelConfig) -> list[LayerWork]:
    """The analytic work of the run's layers ``names`` (``model_sizes.trainer_layer_work``)."""
    try:
        return trainer_layer_work(names, model)
    except ConfigError as e:
        raise InputError(f"the run's layers: {e}") from e


def _partition(names: list[str], bounds: list[int], recompute: list[str]) -> Partition:
    """Stages between ``bounds`` over the layers ``names``, each recomputing its layers named
    in ``recompute``."""
    again = {names.index(n) for n in recompute}
    return Partition(list(bounds), [Stage(a, b, sorted(i for i in again if a <= i < b))
                                    for a, b in zip(bounds[:-1], bounds[1:])])


def described_partition(stages: list[dict]) -> tuple[list[str], Partition]:
    """The layer names and partition ``pipeline.json``'s stages describe."""
    names = [n for s in stages for n in s["layers"]]
    return names, _partition(names, stage_bounds(stages),
                             [n for s in stages for n in s["recompute"]])


def _configured_partition(config: dict, profile: dict) -> Partition:
    """For a run without ``pipeline.json``: the stage bounds and recompute its
    ``train_config.json`` asked for (DeepSpeed's 'parameters' when it gave none, as the
    trainer did before it wrote ``pipeline.json``), over the profile's layers."""
    from vlmshard.partition import LayerCost, deepspeed_bounds

    bounds = config.get("bounds") or deepspeed_bounds(
        [LayerCost.from_dict(lay) for lay in profile["layers"]], config["pp"], "parameters")
    return _partition([lay["name"] for lay in profile["layers"]], bounds,
                      config.get("recompute") or [])


def replay_run(train_log: str, profile_dir: str | None = None, per_kind: bool = False
               ) -> Replay:
    """The run of ``train_log`` (its folder holds ``train_config.json`` and, from this vlmshard
    on, ``pipeline.json``) replayed with the profile's measured layer times (with ``per_kind``:
    the analytic FLOPs of the model it trained at the profile's FLOP rate per layer kind), or
    without ``profile_dir`` with the analytic FLOPs alone."""
    from vlmshard.io import read_json

    records = read_log(train_log)[1:]
    if not records:
        raise InputError(f"{train_log}: needs at least two steps (the first is warm-up)")
    run = os.path.dirname(train_log)
    pipeline_path = os.path.join(run, PIPELINE_NAME)
    pipeline = read_json(pipeline_path) if os.path.exists(pipeline_path) else None
    if profile_dir and not per_kind:
        profile = read_json(os.path.join(profile_dir, "profile.json"))
        profiled = [lay["name"] for lay in profile["layers"]]
        work = None
        if pipeline is None:
            names, partition = profiled, _configured_partition(
                read_json(os.path.join(run, "train_config.json")), profile)
        else:
            names, partition = described_partition(pipeline["stages"])
            _same_layers(profiled, names, profile_dir)
            work = _layer_work(names, ModelConfig.from_dict(pipeline["model"]))
        rates = LayerRates.from_profile(profile, read_json(os.path.join(profile_dir,
                                                                        "cost_model.json")),
                                        work)
        basis = f"the measured layer times of {profile_dir}"
    else:
        if pipeline is None:
            raise InputError(f"{run} has no {PIPELINE_NAME} (a run of an older vlmshard "
                             "train): give the run's profile (--profile) to replay it")
        names, partition = described_partition(pipeline["stages"])
        model = ModelConfig.from_dict(pipeline["model"])
        profile = read_json(os.path.join(profile_dir, "profile.json")) if per_kind else None
        if profile is not None:
            _same_layers([lay["name"] for lay in profile["layers"]], names, profile_dir)
        rates = analytic_rates(names, model, profile,
                               [m for st in pipeline["stages"]
                                for m in st.get("modes", ["train"] * len(st["layers"]))])
        basis = f"the analytic layer FLOPs of the trained model ({model.name})" + (
            f" at the FLOP rates {profile_dir} measured per layer kind" if per_kind else "")
    stages = StageModel.build(rates, partition, float("inf"))  # sends are not modelled
    return Replay(steps=np.array([r["step"] for r in records]),
                  step_time_s=np.array([r["step_time_s"] for r in records], dtype=np.float64),
                  measured=measured_times(records), predicted=replay_batches(records, stages),
                  stage_layers=[names[s.first:s.end] for s in partition.stages], basis=basis,
                  in_seconds=bool(profile_dir))


def _same_layers(profiled: list[str], names: list[str], profile_dir: str) -> None:
    if names != profiled:
        raise InputError(f"{profile_dir} profiles other layers ({', '.join(profiled)}) than the "
                         f"run's ({', '.join(names)})")


def agreement(measured: np.ndarray, predicted: np.ndarray) -> dict:
    """Per-step agreement: Pearson correlation (None when either series is constant) and the
    median absolute error."""
    varies = len(measured) > 1 and measured.std() > 0 and predicted.std() > 0
    return {"correlation": float(np.corrcoef(measured, predicted)[0, 1]) if varies else None,
            "median_abs_error": float(np.median(np.abs(measured - predicted)))}


def compare(replay: Replay) -> dict:
    """The measured pipeline bubble (per stage and overall) and DP waiting next to the
    replay's, over the run and step by step, and the measured rest of the step ("other")."""
    m, p = replay.measured, replay.predicted
    if m is None:
        raise InputError("the log's ranks have no pipeline_s (a run of an older vlmshard "
                         "train): train again to tell the pipeline bubble from DP waiting")
    m_stage, p_stage = m.stage_bubble_per_step(), p.stage_bubble_per_step()
    m_bubble, p_bubble = m_stage.mean(axis=1), p_stage.mean(axis=1)
    m_wait, p_wait = m.waiting_per_step(), p.waiting_per_step()
    m_run, p_run = m.stage_bubble(), p.stage_bubble()
    pipeline_s = m.makespan.max(axis=1)
    out = {
        "steps": len(replay.steps), "dp": m.makespan.shape[1], "pp": len(m_run),
        "basis": replay.basis,
        "bubble": {"measured": float(m_run.mean()), "predicted": float(p_run.mean()),
                   **agreement(m_bubble, p_bubble)},
        "stage_bubble": [{"stage": s, "layers": replay.stage_layers[s],
                          "measured": float(m_run[s]), "predicted": float(p_run[s]),
                          **agreement(m_stage[:, s], p_stage[:, s])}
                         for s in range(len(m_run))],
        "dp_waiting": {"measured": m.waiting(), "predicted": p.waiting(),
                       **agreement(m_wait, p_wait)},
        "other_measured": float(share(pipeline_s.sum(), replay.step_time_s.sum())),
        "per_step": [{"step": int(step), "step_time_s": float(t),
                      "measured": {"stage_bubble": ms.tolist(), "dp_waiting": float(mw)},
                      "predicted": {"stage_bubble": ps.tolist(), "dp_waiting": float(pw)}}
                     for step, t, ms, ps, mw, pw in zip(replay.steps, replay.step_time_s,
                                                        m_stage, p_stage, m_wait, p_wait)],
    }
    if replay.in_seconds:
        out["step_seconds"] = step_seconds(replay)
    return out


def step_seconds(replay: Replay) -> dict:
    """Replayed step times (the slowest replica's pipeline) against the measured ones."""
    predicted = replay.predicted.makespan.max(axis=1)
    measured = replay.step_time_s
    error = np.abs(predicted - measured) / measured
    return {"steps": len(replay.steps), "predicted_s": float(predicted.sum()),
            "measured_s": float(measured.sum()),
            "total_error": float(predicted.sum() / measured.sum() - 1),
            "median_step_error": float(np.median(error)),
            "per_step": [{"step": int(s), "predicted_s": float(p), "measured_s": float(t)}
                         for s, p, t in zip(replay.steps, predicted, measured)]}


def validate_against_log(train_log: str, profile_dir: str) -> dict:
    """Each logged step re-simulated with the profile's measured layer times and the run's
    partition, against the measured step time (``vlmshard simulate --train-log``)."""
    return step_seconds(replay_run(train_log, profile_dir))
