"""vlmshard report: the table holds plan.json's metrics with a column per plan, the per-step series
average to those metrics, a training log is checked against its plan and its measured pipeline
bubble and DP waiting set against the simulator's replay, the HTML page is self-contained and a
browser shows every plot."""

from __future__ import annotations

import base64
import html.parser
import io
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from vlmshard.report import plots
from vlmshard.packing.metrics import format_value
from vlmshard.packing.cost import CostModel
from vlmshard.packing.metrics import REPORT_KEYS, measure
from vlmshard.packing.config import PackConfig
from vlmshard.packing.plan import read_plan, run_pack
from vlmshard.packing.plan import read_plan_json
from vlmshard.report.report import baseline_plans, load_plan, make_report, plan_labels
from vlmshard.report.series import PlanSeries, plan_series
from vlmshard.packing.stats import load_stats
from vlmshard.families import presets
from vlmshard.model_sizes import layer_work, training_flops
from vlmshard.simulate.model import PipelineTimes
from vlmshard.run_log import PIPELINE_NAME
from vlmshard.simulate.replay import Replay, replay_run
from vlmshard.train.train_log import (pipeline_record, rank_data, rank_timing, step_record,
                                      write_record)

from helpers import vlmshard
from length_mixes import mostly_text, write_length_file
from pipeline_reference import makespan

META = os.path.join(os.path.dirname(__file__), "data", "omnibal", "meta.json")
ROWS = ["step_efficiency", "pad_ratio", "vit_dist_ratio", "llm_dist_ratio", "attn_dist_ratio",
        "vit_fill", "llm_fill", "cost_efficiency", "order_spearman", "source_mix_tv", "steps",
        "micro_batches", "samples", "unplaced", "qv", "qt", "pack_seconds"]
TRAIN_STEPS = 50  # past the balanced plan's 40 steps: the trainer starts over, so does the log
FIGURES = 6  # comparison, imbalance, fill, cumulative load, source mix, training log


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    """The bundled OmniBal lengths packed by two strategies for 4 data-parallel ranks."""
    root = tmp_path_factory.mktemp("plans")
    for algo in ("balanced", "random"):
        run_pack(PackConfig(stats=META, dp=4, out=str(root / algo), algo=algo, seed=1))
    return {algo: root / algo for algo in ("balanced", "random")}


def _micro_batches(plan_dir: Path) -> dict[tuple[int, int, int], list[int]]:
    """(step, rank, micro) -> sample ids in slot order, straight from plan.parquet."""
    out: dict[tuple[int, int, int], list[int]] = {}
    for row in pq.read_table(plan_dir / "plan.parquet").to_pylist():
        out.setdefault((row["step"], row["rank"], row["micro"]), []).append(row["sample_id"])
    return out


def _omnibal_lengths() -> tuple[np.ndarray, np.ndarray]:
    """Tiles and tokens per sample_id, read straight from the OmniBal files (meta order)."""
    rows = []
    for name in json.loads(Path(META).read_text()).values():
        rows += json.loads((Path(META).parent / name["token_lengths"]).read_text())
    return (np.array([r["vit_num"] for r in rows], np.int64),
            np.array([r["token_num"] for r in rows], np.int64))


def _rank_costs(plan_dir: Path, dp: int) -> np.ndarray:
    """[plan steps, dp] each DP rank's cost (a_v·tiles + a_t·tokens + b·Σlen² + a_s·supervised)
    at each plan step, computed here from plan.parquet, the OmniBal files and plan.json's cost
    model. OmniBal's rows hold no labels: every token counts as supervised."""
    info = json.loads((plan_dir / "plan.json").read_text())
    tiles, tokens = _omnibal_lengths()
    a_v, a_t, b, a_s = (info["cost_model"][k] for k in ("a_v", "a_t", "b", "a_s"))
    ranks, steps = info["params"]["ranks"], info["metrics"]["steps"]
    cost = np.zeros((steps, dp))
    for (step, rank, _), ids in _micro_batches(plan_dir).items():
        t = tokens[ids].astype(float)
        cost[step, rank // (ranks // dp)] += (a_v * tiles[ids].sum() + (a_t + a_s) * t.sum()
                                              + b * (t ** 2).sum())
    return cost


def _expected_waits(plan_dir: Path, dp: int) -> np.ndarray:
    """[steps, dp] the share of each plan step a DP rank would wait if its time were its cost."""
    cost = _rank_costs(plan_dir, dp)
    return 1 - cost / cost.max(axis=1, keepdims=True)


BUBBLE_S = 0.1  # the synthetic run's pipelines last this longer than their busiest stage
OTHER_S = 0.05  # and its steps this longer than their longest pipeline
MODEL = presets()["internvl2-2b"]


def _compute_seconds(plan_dir: Path, dp: int, pp: int, steps: int) -> np.ndarray:
    """[steps, pp, dp] the synthetic run's compute time of each rank: its DP rank's cost, scaled
    to at most 0.5 s, times a fixed pseudo-random factor in [0.9, 1.1] per rank and step (so
    measured times are not the replay's prediction in disguise)."""
    cost = _rank_costs(plan_dir, dp)
    cost = cost[np.arange(steps) % len(cost)]
    jitter = np.random.default_rng(0).uniform(0.9, 1.1, (steps, pp, dp))
    return 0.5 * cost[:, None, :] / cost.max() * jitter


def _pipeline_seconds(compute: np.ndarray) -> np.ndarray:
    """[steps, pp, dp] each rank's pipeline_s: its replica's busiest stage plus BUBBLE_S on
    stage 0, which ends last, 10 ms less on each later stage."""
    stages = compute.shape[1]
    return (compute.max(axis=1, keepdims=True) + BUBBLE_S
            - 0.01 * np.arange(stages)[None, :, None])


def _loader_batch(plan_step: int, ids: list[int], tiles: np.ndarray, tokens: np.ndarray) -> dict:
    """The fields of a loader micro-batch that the trainer's log records read."""
    lens = tokens[ids]
    return {"step": plan_step, "sample_ids": np.array(ids, np.int64),
            "num_tokens": int(lens.sum()), "num_tiles": int(tiles[ids].sum()),
            "num_samples": len(ids), "cu_seqlens": np.r_[0, np.cumsum(lens)]}


def _stage_layers() -> list[list[str]]:
    """The trainer's InternVL layers of MODEL in two stages: vision and projector | language."""
    return [["vit_embed", *(f"vit_block_{i}" for i in range(MODEL.vision.layers)), "projector",
             "embed_tokens"],
            [*(f"llm_block_{i}" for i in range(MODEL.llm.layers)), "final_norm", "head"]]


def write_train_log(plan_dir: Path, path: Path, dp: int, pp: int = 2,
                    steps: int = TRAIN_STEPS) -> None:
    """A train_log.jsonl (and the pipeline.json beside it) for a run of MODEL on ``plan_dir``'s
    shards with ``dp`` × 2 ranks, made by the trainer's own record functions
    (vlmshard.train.train_log). Each DP rank trains its virtual ranks' micro-batches of the plan
    (from plan step 0 again after the last); rank (stage, d) computes for ``_compute_seconds``
    (forward 1/3, backward 2/3), its pipeline ends after ``_pipeline_seconds``, and the step
    lasts the longest pipeline plus OTHER_S."""
    info = json.loads((plan_dir / "plan.json").read_text())
    ranks, micro = info["params"]["ranks"], info["params"]["micro_batches"]
    plan_steps = info["metrics"]["steps"]
    batches = _micro_batches(plan_dir)
    tiles, tokens = _omnibal_lengths()
    compute = _compute_seconds(plan_dir, dp, pp, steps)
    pipeline = _pipeline_seconds(compute)
    flops = training_flops(MODEL)
    per_dp = ranks // dp
    with open(path, "w", encoding="utf-8") as f:
        for step in range(steps):
            s = step % plan_steps
            seconds = pipeline[step].max() + OTHER_S
            timings = []
            for stage in range(pp):
                for d in range(dp):
                    c = float(compute[step, stage, d])
                    timing = rank_timing(rank=stage * dp + d, stage=stage, dp_rank=d,
                                         forward_s=c / 3, backward_s=2 * c / 3,
                                         pipeline_s=float(pipeline[step, stage, d]),
                                         step_time_s=float(seconds))
                    if stage == 0:
                        timing["data"] = rank_data(
                            [_loader_batch(s, batches[(s, v, m)], tiles, tokens)
                             for v in range(d * per_dp, (d + 1) * per_dp) for m in range(micro)],
                            MODEL)
                    timings.append(timing)
            write_record(f, step_record(step, 2.0, 1e-5, timings, flops))
    stages = [(stage, layers, [], []) for stage, layers in enumerate(_stage_layers())]
    (path.parent / PIPELINE_NAME).write_text(json.dumps(pipeline_record(MODEL.to_dict(),
                                                                        stages)))


def _expected_measured(plan_dir: Path, dp: int, steps: int) -> PipelineTimes:
    """The synthetic run's replica pipelines and stage busy times, from the times the log was
    made from (not from the log), warm-up step left out."""
    compute = _compute_seconds(plan_dir, dp, 2, steps)[1:]
    return PipelineTimes(_pipeline_seconds(compute).max(axis=1), compute.transpose(0, 2, 1))


def _expected_predicted(plan_dir: Path, dp: int, steps: int) -> PipelineTimes:
    """The replay computed here: each replica's micro-batches (plan.parquet and the OmniBal
    files) through tests/pipeline_reference's 1F1B, stage 0 (ViT, projector) taking MODEL's
    ViT FLOPs of its tiles, stage 1 its LLM FLOPs of tokens and squared lengths (training_flops
    is forward + backward, 3x the forward), backward twice the forward."""
    info = json.loads((plan_dir / "plan.json").read_text())
    ranks, micro = info["params"]["ranks"], info["params"]["micro_batches"]
    plan_steps = info["metrics"]["steps"]
    batches = _micro_batches(plan_dir)
    tiles, tokens = _omnibal_lengths()
    flops = training_flops(MODEL)
    # the patch embedding's forward, whose backward is its weights' gradient alone
    embed = layer_work(MODEL)[0].flops.tiles
    per_dp = ranks // dp
    spans, busy = np.zeros((steps - 1, dp)), np.zeros((steps - 1, dp, 2))
    for step in range(1, steps):
        s = step % plan_steps
        for d in range(dp):
            forward, backward = [], []
            for v in range(d * per_dp, (d + 1) * per_dp):
                for m in range(micro):
                    ids = batches[(s, v, m)]
                    t = tokens[ids].astype(float)
                    vit = flops.tiles * tiles[ids].sum()
                    llm = ((flops.tokens + flops.supervised) * t.sum()
                           + flops.squares * (t ** 2).sum())
                    ahead = (vit + embed * tiles[ids].sum()) / 3
                    forward.append([ahead, llm / 3])
                    backward.append([vit - ahead, 2 * llm / 3])
            spans[step - 1, d] = makespan(forward, backward)
            busy[step - 1, d] = (np.array(forward) + np.array(backward)).sum(axis=0)
    return PipelineTimes(spans, busy)


@pytest.fixture(scope="module")
def report_run(plans, tmp_path_factory) -> dict:
    """One ``vlmshard report balanced random --train-log --html --out-json``, as a user runs it."""
    out = tmp_path_factory.mktemp("report")
    write_train_log(plans["balanced"], out / "train_log.jsonl", dp=4)
    proc = vlmshard("report", str(plans["balanced"]), str(plans["random"]), "--train-log",
                    str(out / "train_log.jsonl"), "--html", str(out / "report.html"), "--out-json",
                    str(out / "report.json"))
    return {"stdout": proc.stdout, "html": out / "report.html", "json": out / "report.json",
            "log": out / "train_log.jsonl"}


def _metrics(plan_dir: Path) -> dict:
    """plan.json's metrics, with pack_seconds from the run's facts (plan.run.json)."""
    facts = json.loads((plan_dir / "plan.run.json").read_text())
    return {**json.loads((plan_dir / "plan.json").read_text())["metrics"],
            "pack_seconds": facts["timings"]["pack_seconds"]}


# --- the table and JSON -------------------------------------------------------------------------

def test_table_has_a_column_per_plan_holding_plan_json_metrics(plans, report_run):
    lines = report_run["stdout"].splitlines()
    lines = lines[next(i for i, line in enumerate(lines) if line.startswith("metric")):]
    assert lines[0].split() == ["metric", "balanced", "random"]
    table = {line.split()[0]: line.split()[1:] for line in lines[1:1 + len(ROWS)]}
    assert list(table) == ROWS
    for key in ROWS:
        assert table[key] == [format_value(_metrics(plans[a])[key]) for a in ("balanced",
                                                                               "random")], key
    report = json.loads(report_run["json"].read_text())
    assert [p["label"] for p in report["plans"]] == ["balanced", "random"]
    for entry, algo in zip(report["plans"], ("balanced", "random")):
        assert entry["plan_dir"] == str(plans[algo]) and entry["algorithm"] == algo
        assert entry["metrics"] == {k: _metrics(plans[algo])[k] for k in ROWS}  # exactly


def test_the_summary_compares_the_plan_with_random_and_isf_packings(plans, report_run,
                                                                    tmp_path):
    """The opening line: the plan's step_efficiency and its predicted speed over random and
    ISF packings of the same stats, which the report packs itself: the figures equal those of
    plans packed here with the same options."""
    run_pack(PackConfig(stats=META, dp=4, out=str(tmp_path / "isf"), algo="isf", seed=1))
    own = {algo: json.loads((plans[algo] / "plan.json").read_text())["metrics"]
           ["step_efficiency"] for algo in plans}
    isf = json.loads((tmp_path / "isf" / "plan.json").read_text())["metrics"]["step_efficiency"]
    summary = json.loads(report_run["json"].read_text())["summary"]
    assert summary["plan"] == "balanced" and summary["step_efficiency"] == own["balanced"]
    assert summary["baseline_step_efficiency"] == {"random": own["random"], "isf": isf}
    first = report_run["stdout"].splitlines()[0]
    assert first == summary["text"]
    assert f"{100 * own['balanced']:.1f}% of their time on useful work" in first
    assert f"{own['balanced'] / own['random']:.2f}x that of random packing" in first
    assert f"{own['balanced'] / isf:.2f}x that of isf packing" in first
    assert own["balanced"] > isf > own["random"]


def test_baselines_pack_exactly_the_plans_samples_under_caps_that_hold_them(tmp_path):
    """ISF's own caps (OmniBal's search for 4 samples a group) leave mostly-text data's image
    samples out. The report's baselines pack exactly the samples the plan packs (not the long
    texts it leaves over its caps), under caps raised to hold them; the speed ratio compares
    those samples, as plans packed here of those samples alone give it; nothing the report
    prints about them reads as the plan's."""
    lengths = mostly_text()
    stats = write_length_file(tmp_path / "lengths.json", lengths)
    plan = tmp_path / "plan"  # the 2 long texts (ids 203, 204) over --max-qt: 0.98%, allowed
    run_pack(PackConfig(stats=stats, dp=2, out=str(plan), max_qt=3000))
    proc = vlmshard("report", str(plan), "--json")
    assert "exceed the caps" not in proc.stderr and "WARNING" not in proc.stderr
    report = json.loads(proc.stdout)
    # the plan's 203 samples alone, packed here by pack itself: isf under its own search's
    # caps raised to the largest sample's 20 tiles and 2000 tokens, random padded
    own = write_length_file(tmp_path / "own.json", lengths.take(np.arange(203)))
    searched = run_pack(PackConfig(stats=own, dp=2, out=str(tmp_path / "searched"), algo="isf",
                                   max_unplaced_ratio=1.0)).metrics
    assert searched.qv < 20  # isf's own caps would leave the images out
    expected = {"isf": run_pack(PackConfig(stats=own, dp=2, out=str(tmp_path / "isf"),
                                           algo="isf", qv=20, qt=max(searched.qt, 2000))),
                "random": run_pack(PackConfig(stats=own, dp=2, out=str(tmp_path / "random"),
                                              algo="random"))}
    efficiency = report["summary"]["step_efficiency"]
    for algo, packed in expected.items():
        baseline = report["baselines"][algo]
        assert baseline["plan_samples"] == 203
        assert baseline["metrics"]["samples"] + baseline["metrics"]["unplaced"] == 203
        assert {k: baseline["metrics"][k] for k in ("step_efficiency", "samples", "qv", "qt")} \
            == {k: getattr(packed.metrics, k) for k in ("step_efficiency", "samples", "qv", "qt")}
        assert report["summary"]["baseline_step_efficiency"][algo] == \
            packed.metrics.step_efficiency
        assert (f"{efficiency / packed.metrics.step_efficiency:.2f}x that of {algo} packing"
                in report["summary"]["text"])
    assert report["baselines"]["isf"]["chosen_caps"] == {"qv": searched.qv, "qt": searched.qt}
    # the samples themselves: the plan's, each placed once or its baseline's remainder
    _, packing, _ = load_plan(str(plan))
    for _, baseline in baseline_plans(read_plan_json(str(plan)), lengths).values():
        assert sorted(np.r_[baseline.items, baseline.unplaced].tolist()) == list(range(203))
        assert set(baseline.unplaced_reason) <= {"remainder"}
    assert sorted(packing.items.tolist()) == list(range(203))
    text = vlmshard("report", str(plan)).stdout
    assert (f"isf baseline: its own caps (Qv {searched.qv}, Qt {searched.qt}) would leave some "
            f"of them out; packed under Qv 20, Qt {max(searched.qt, 2000)}") in text


def test_a_baseline_that_makes_no_step_says_so_as_the_baselines(tmp_path):
    """Random packing takes --target-samples (4) samples a micro-batch: of a plan's 3 samples
    it makes no step, and the warning names that baseline, not the user's plan."""
    stats = write_length_file(tmp_path / "three.json", mostly_text().take(np.arange(3)))
    run_pack(PackConfig(stats=stats, dp=1, out=str(tmp_path / "plan")))
    proc = vlmshard("report", str(tmp_path / "plan"), "--json")
    assert proc.stderr.splitlines()[-1].endswith(
        "the report's random baseline makes no whole step of the plan's 3 samples: no "
        "comparison with it")
    assert "the plan places no sample" not in proc.stderr
    assert list(json.loads(proc.stdout)["baselines"]) == ["isf"]


def test_a_plan_whose_stats_are_gone_is_reported_without_baselines(tmp_path):
    stats = write_length_file(tmp_path / "lengths.json", mostly_text())
    run_pack(PackConfig(stats=stats, dp=2, out=str(tmp_path / "plan")))
    os.remove(stats)
    proc = vlmshard("report", str(tmp_path / "plan"), "--json")
    assert "no comparison with other packings: " in proc.stderr
    assert f"{stats}: no such file or folder" in proc.stderr
    assert json.loads(proc.stdout)["baselines"] == {}


def test_json_dash_prints_what_json_path_writes(plans, tmp_path):
    path = tmp_path / "r.json"
    proc = vlmshard("report", str(plans["random"]), "--out-json", str(path))
    assert proc.stdout.splitlines()[0].startswith("random: the ranks spend")
    assert proc.stdout.splitlines()[2].split() == ["metric", "random"]
    printed = vlmshard("report", str(plans["random"]), "--json").stdout
    assert printed == path.read_text()
    assert sorted(json.loads(printed)["plans"][0]["metrics"]) == sorted(ROWS)
    assert set(ROWS) == {*REPORT_KEYS, "source_mix_tv"}


def test_labels_are_algorithms_then_folder_names_then_paths():
    same = [{"algorithm": "balanced"}, {"algorithm": "balanced"}]
    assert plan_labels(["a/x", "b/y"], [{"algorithm": "isf"}, {"algorithm": "random"}]) == [
        "isf", "random"]
    assert plan_labels(["a/x/", "b/y"], same) == ["x", "y"]
    assert plan_labels(["a/x", "b/x"], same) == ["a/x", "b/x"]


# --- the series behind the plots ----------------------------------------------------------------

def test_read_plan_gives_back_the_packing_pack_measured(plans):
    lengths = load_stats(META).lengths
    for algo, plan_dir in plans.items():
        info, packing = read_plan(str(plan_dir))
        again = measure(lengths, packing, qv=info["params"]["qv"], qt=info["params"]["qt"],
                        cost=CostModel(**info["cost_model"]), padded=algo == "random",
                        dp=info["params"]["dp"], pack_seconds=info["metrics"]["pack_seconds"])
        assert again.to_dict() == info["metrics"]


def test_per_step_series_average_to_the_plan_metrics(plans):
    for algo, plan_dir in plans.items():
        info, packing, lengths = load_plan(str(plan_dir))
        m = info["metrics"]
        s = plan_series(algo, info, packing, lengths)
        assert len(s.vit_imbalance) == len(s.rank_cost) == len(s.source_shares) == m["steps"]
        assert s.rank_cost.shape[1] == 4 and len(s.tile_fill) == m["micro_batches"]
        assert s.vit_imbalance.mean() == pytest.approx(m["vit_dist_ratio"], abs=1e-12)
        assert s.llm_imbalance.mean() == pytest.approx(m["llm_dist_ratio"], abs=1e-12)
        assert s.attn_imbalance.mean() == pytest.approx(m["attn_dist_ratio"], abs=1e-12)
        assert s.tile_fill.mean() == pytest.approx(m["vit_fill"], abs=1e-12)
        assert s.token_fill.mean() == pytest.approx(m["llm_fill"], abs=1e-12)
        assert (s.tile_fill <= 1).all() and (s.token_fill <= 1).all()  # the caps hold
        C = s.rank_cost
        assert C.mean(axis=1).sum() / C.max(axis=1).sum() == pytest.approx(m["cost_efficiency"])
        assert 1 - C.mean(axis=1) / C.max(axis=1) == pytest.approx(
            _expected_waits(plan_dir, 4).mean(axis=1))
        counts = np.zeros((m["steps"], 2))  # source mix, from plan.parquet and the stats
        for (step, _, _), ids in _micro_batches(plan_dir).items():
            counts[step] += np.bincount(lengths.source[ids], minlength=2)
        assert s.sources == ("ai2d", "docvqa")
        assert s.source_shares == pytest.approx(counts / counts.sum(axis=1, keepdims=True))
        overall = counts.sum(axis=0) / counts.sum()
        tv = 0.5 * np.abs(s.source_shares - overall).sum(axis=1)
        assert tv.mean() == pytest.approx(m["source_mix_tv"])
    bal, rnd = (plan_series(a, *load_plan(str(plans[a]))) for a in ("balanced", "random"))
    assert np.median(bal.llm_imbalance) < np.median(rnd.llm_imbalance)


# --- the training log ---------------------------------------------------------------------------

def _agreement(measured: np.ndarray, predicted: np.ndarray) -> tuple[float, float]:
    """Per-step Pearson correlation and median absolute error, computed here."""
    return (float(np.corrcoef(measured, predicted)[0, 1]),
            float(np.median(np.abs(measured - predicted))))


def _shares(t: PipelineTimes) -> dict:
    """Bubble per stage and DP waiting over the run and per step, by their definitions, written
    out here: a stage's bubble is 1 − its busy time over its replicas' pipeline time; waiting is
    1 − the replicas' pipeline time over D times the slowest's."""
    steps, dp, stages = t.busy.shape
    span = t.makespan
    return {"stage": [1 - t.busy[:, :, s].sum() / span.sum() for s in range(stages)],
            "waiting": 1 - span.sum() / (dp * span.max(axis=1).sum()),
            "stage_per_step": 1 - t.busy.sum(axis=1) / span.sum(axis=1)[:, None],
            "waiting_per_step": 1 - span.sum(axis=1) / (dp * span.max(axis=1))}


def test_train_log_measured_bubble_and_waiting_against_the_replay(plans, report_run):
    """The report's training figures equal those computed here from the times the synthetic
    log was made from and from an independent 1F1B replay of its micro-batches."""
    summary = json.loads(report_run["json"].read_text())["train_log"]
    measured = _shares(_expected_measured(plans["balanced"], 4, TRAIN_STEPS))
    predicted = _shares(_expected_predicted(plans["balanced"], 4, TRAIN_STEPS))
    assert summary["plan"] == "balanced" and summary["steps"] == TRAIN_STEPS - 1  # warm-up
    assert summary["dp"] == 4 and summary["pp"] == 2
    assert "analytic layer FLOPs of the trained model (internvl2-2b)" in summary["basis"]
    for s, entry in enumerate(summary["stage_bubble"]):
        assert entry["layers"] == _stage_layers()[s]
        assert entry["measured"] == pytest.approx(measured["stage"][s], rel=1e-9)
        assert entry["predicted"] == pytest.approx(predicted["stage"][s], rel=1e-9)
        correlation, error = _agreement(measured["stage_per_step"][:, s],
                                        predicted["stage_per_step"][:, s])
        assert entry["correlation"] == pytest.approx(correlation, rel=1e-9)
        assert entry["median_abs_error"] == pytest.approx(error, rel=1e-9)
    assert summary["bubble"]["measured"] == pytest.approx(np.mean(measured["stage"]), rel=1e-9)
    assert summary["bubble"]["predicted"] == pytest.approx(np.mean(predicted["stage"]),
                                                           rel=1e-9)
    waiting = summary["dp_waiting"]
    assert waiting["measured"] == pytest.approx(measured["waiting"], rel=1e-9)
    assert waiting["predicted"] == pytest.approx(predicted["waiting"], rel=1e-9)
    correlation, error = _agreement(measured["waiting_per_step"], predicted["waiting_per_step"])
    assert waiting["correlation"] == pytest.approx(correlation, rel=1e-9)
    assert waiting["median_abs_error"] == pytest.approx(error, rel=1e-9)
    # other: the step beyond its longest pipeline (OTHER_S of each step)
    pipelines = _pipeline_seconds(_compute_seconds(plans["balanced"], 4, 2, TRAIN_STEPS))[1:]
    longest = pipelines.max(axis=(1, 2))
    assert summary["other_measured"] == pytest.approx(
        OTHER_S * len(longest) / (longest + OTHER_S).sum(), rel=1e-9)
    assert "step_seconds" not in summary  # no profile: no seconds predicted
    per_step = summary["per_step"]
    assert [p["step"] for p in per_step] == list(range(1, TRAIN_STEPS))
    assert [p["measured"]["dp_waiting"] for p in per_step] == pytest.approx(
        measured["waiting_per_step"], rel=1e-9)
    # the summary and the terminal state them side by side
    sentence = (f"pipeline bubble measured {summary['bubble']['measured']:.3f} (predicted "
                f"{summary['bubble']['predicted']:.3f}), DP waiting measured "
                f"{waiting['measured']:.3f} (predicted {waiting['predicted']:.3f})")
    assert sentence in json.loads(report_run["json"].read_text())["summary"]["text"]
    assert sentence in report_run["stdout"].splitlines()[0]
    assert "Step time: not predicted" in report_run["stdout"]


@pytest.mark.parametrize("dp", [4, 2])
def test_replay_of_a_run_per_step_and_replica(plans, tmp_path, dp):
    """The random plan has 4 ranks; a run with dp=2 trains 2 virtual ranks per DP rank, so
    each replica's pipeline takes two micro-batches a step."""
    log = tmp_path / "train_log.jsonl"
    write_train_log(plans["random"], log, dp=dp, pp=2, steps=20)
    replay = replay_run(str(log))
    assert replay.steps.tolist() == list(range(1, 20)) and not replay.in_seconds
    assert replay.stage_layers == _stage_layers()
    for got, want in ((replay.measured, _expected_measured(plans["random"], dp, 20)),
                      (replay.predicted, _expected_predicted(plans["random"], dp, 20))):
        assert got.makespan.shape == (19, dp)
        assert got.makespan == pytest.approx(want.makespan, rel=1e-9)
        assert got.busy.ravel() == pytest.approx(want.busy.ravel(), rel=1e-9)


def _rewrite(src: Path, dst: Path, edit) -> Path:
    records = [json.loads(line) for line in src.read_text().splitlines()]
    edit(records)
    dst.write_text("".join(json.dumps(r) + "\n" for r in records))
    return dst


def _step_out_of_range(records):
    records[3]["data"][1]["plan_steps"] = [999]


def _other_samples(records):
    records[2]["data"][0]["sample_ids"][0][0] += 1


def _no_ranks(records):
    del records[1]["ranks"]


def _no_pipeline_s(records):
    for record in records:
        for rank in record["ranks"]:
            del rank["pipeline_s"]


@pytest.mark.parametrize("case, message", [
    ("missing plan", "no plan.json here"),
    ("unreadable line", "train_log.jsonl line 2: not JSON"),
    ("step out of range", "line 4: plan step 999 is outside the plan's {steps} steps: this log "
                          "is not from this plan"),
    ("other samples", "line 3: dp rank 0 trained other samples than the plan places at step(s) "
                      "[2]"),
    ("no ranks", "line 2: not a train_log record (missing 'ranks')"),
    ("dp does not divide", "trained on 3 data-parallel rank(s), which does not divide the plan's "
                           "4 ranks"),
    ("empty log", "no training steps in it"),
    ("no pipeline_s", "train_log.jsonl: the log's ranks have no pipeline_s (a run of an older "
                      "vlmshard train): train again"),
    ("no pipeline.json", "has no pipeline.json (a run of an older vlmshard train): give the "
                         "run's profile (--profile)"),
])
def test_errors_are_one_line(plans, report_run, tmp_path, case, message):
    good = report_run["log"]
    log = tmp_path / "train_log.jsonl"
    plan = str(plans["balanced"])
    if case == "missing plan":
        plan, log = str(tmp_path / "nope"), good
    elif case == "unreadable line":
        lines = good.read_text().splitlines(keepends=True)
        log.write_text(lines[0] + '{"step": 1, "loss": \n' + "".join(lines[2:]))
    elif case == "step out of range":
        _rewrite(good, log, _step_out_of_range)
    elif case == "other samples":
        _rewrite(good, log, _other_samples)
    elif case == "no ranks":
        _rewrite(good, log, _no_ranks)
    elif case == "dp does not divide":
        _rewrite(good, log, lambda records: [r["data"].pop() for r in records])
    elif case == "no pipeline_s":  # a log of an older trainer, pipeline.json beside it
        _rewrite(good, log, _no_pipeline_s)
        shutil.copy(good.parent / PIPELINE_NAME, log.parent / PIPELINE_NAME)
    elif case == "no pipeline.json":
        shutil.copy(good, log)
    else:
        log.write_text("\n")
    proc = vlmshard("report", plan, "--train-log", str(log), check=False)
    assert proc.returncode != 0
    message = message.format(steps=_metrics(plans["balanced"])["steps"])
    assert proc.stderr.startswith("vlmshard report: error: ") and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


# --- the HTML page ------------------------------------------------------------------------------

class _Page(html.parser.HTMLParser):
    """Every tag with its attributes, and the text of figcaptions and table rows."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.captions: list[str] = []
        self.rows: list[list[str]] = []
        self._in: str | None = None

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag == "figcaption":
            self._in = "caption"
            self.captions.append("")
        elif tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._in = "cell"
            self.rows[-1].append("")

    def handle_endtag(self, tag):
        if tag in ("figcaption", "td", "th"):
            self._in = None

    def handle_data(self, data):
        if self._in == "caption":
            self.captions[-1] += data
        elif self._in == "cell":
            self.rows[-1][-1] += data


def _non_white(png: bytes) -> float:
    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("L"))
    return float((pixels < 240).mean())


def test_html_is_self_contained_with_a_png_per_plot(plans, report_run):
    text = report_run["html"].read_text(encoding="utf-8")
    page = _Page()
    page.feed(text)
    tags = [t for t, _ in page.tags]
    assert "script" not in tags and "link" not in tags and "iframe" not in tags
    ids = {attrs["id"] for _, attrs in page.tags if attrs.get("id")}
    for _, attrs in page.tags:  # nothing is fetched from anywhere; links stay on the page
        assert not attrs.get("src") or attrs["src"].startswith("data:image/png;base64,")
        assert not attrs.get("href") or attrs["href"][1:] in ids
    contents = [attrs["href"] for tag, attrs in page.tags if tag == "a"]
    assert contents == ["#tables"] + [f"#figure-{k}" for k in range(FIGURES)]
    images = [attrs for tag, attrs in page.tags if tag == "img"]
    assert len(images) == FIGURES and len(page.captions) == FIGURES
    assert all(len(c) > 40 for c in page.captions)
    for attrs in images:
        png = base64.b64decode(attrs["src"].split(",", 1)[1], validate=True)
        image = Image.open(io.BytesIO(png))
        assert image.format == "PNG"
        assert image.size == (int(attrs["width"]), int(attrs["height"]))
        assert attrs["alt"] and _non_white(png) > 0.02
    assert page.rows[0] == ["metric", "balanced", "random"]
    assert [r[0] for r in page.rows[1:1 + len(ROWS)]] == ROWS
    assert page.rows[1 + ROWS.index("llm_dist_ratio")][1:] == [
        format_value(_metrics(plans[a])["llm_dist_ratio"]) for a in ("balanced", "random")]
    # the cost models' table, then the training run's
    assert page.rows[1 + len(ROWS)] == ["cost model", "balanced", "random"]
    train = page.rows[[r[0] for r in page.rows].index("training run"):]
    assert train[0][:3] == ["training run", "measured", "predicted"]
    assert [r[0] for r in train[1:]] == [
        "bubble, stage 0 (vit_embed .. embed_tokens)", "bubble, stage 1 (llm_block_0 .. head)",
        "bubble, all stages", "DP waiting", "other (all-reduce, optimizer)"]
    summary = json.loads(report_run["json"].read_text())["train_log"]
    assert train[3][1:3] == [f"{summary['bubble'][k]:.3f}" for k in ("measured", "predicted")]


def test_chromium_shows_every_plot(report_run, tmp_path):
    """Open the page in headless Chromium as a person would: every image decoded, laid out at a
    real size, and its pixels on screen are a plot, not a blank box."""
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("Debian's chromium and chromium-driver are not installed (make test's "
                    "set-up installs them when it runs as root or with sudo)")
    from selenium import webdriver
    from selenium.webdriver.common.by import By

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1200,900", f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(arg)
    browser = webdriver.Chrome(options=options,
                               service=webdriver.ChromeService(executable_path=driver))
    try:
        browser.get(report_run["html"].as_uri())
        assert browser.title == "vlmshard report"
        # The summary is the first thing read: on screen before any scrolling.
        summary = browser.find_element(By.ID, "summary")
        bottom, viewport = browser.execute_script(
            "return [arguments[0].getBoundingClientRect().bottom, window.innerHeight]", summary)
        assert summary.is_displayed() and 0 < bottom <= viewport
        assert "of their time on useful work" in summary.text
        assert "pipeline bubble measured" in summary.text and "DP waiting measured" in summary.text
        assert _non_white(summary.screenshot_as_png) > 0.02
        images = browser.find_elements(By.TAG_NAME, "img")
        assert len(images) == FIGURES
        for image in images:
            browser.execute_script("arguments[0].scrollIntoView();", image)
            loaded = browser.execute_script(
                "return arguments[0].complete && arguments[0].naturalWidth", image)
            assert loaded and loaded > 0
            assert image.is_displayed()
            assert image.size["width"] > 500 and image.size["height"] > 200
            assert _non_white(image.screenshot_as_png) > 0.02
        page = browser.get_screenshot_as_png()
        assert _non_white(page) > 0.02
    finally:
        browser.quit()


def test_many_sources_and_stages_keep_the_legends_short():
    """Twelve sources fold into the 8 largest plus "other"; 16 ranks, or 16 stages, share one
    legend entry; 2 ranks get one each."""
    rng = np.random.default_rng(0)
    steps, dp, n_sources, stages = 30, 16, 12, 16
    counts = rng.integers(0, 5, (steps, n_sources)) + np.arange(n_sources)  # larger ids, larger
    metrics = {key: 0.5 for key, _ in plots.COMPARED}
    series = PlanSeries("x", metrics, *rng.random((3, steps)), rng.random(80), rng.random(80),
                        rng.random((steps, dp)), counts / counts.sum(axis=1, keepdims=True),
                        tuple(f"s{i}" for i in range(n_sources)))
    legend = plots.source_mix_figure([series]).axes[0].get_legend()
    names = [t.get_text() for t in legend.get_texts()]
    assert names == [f"s{i}" for i in range(4, 12)] + ["other"]
    legend = plots.cumulative_load_figure([series]).axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == [
        "each of 16 ranks", "Σ slowest rank (step-synchronous time)"]
    few = PlanSeries("y", metrics, *rng.random((3, steps)), rng.random(80), rng.random(80),
                     rng.random((steps, 2)), series.source_shares, series.sources)
    legend = plots.cumulative_load_figure([few]).axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()][:2] == ["rank 0", "rank 1"]
    busy = rng.random((steps, 2, stages))
    times = PipelineTimes(busy.sum(axis=2), busy)
    replay = Replay(np.arange(steps), np.full(steps, 100.0), times, times,
                    [[f"layer_{s}"] for s in range(stages)], "test", False)
    bars, scatter, lines = plots.train_figure(replay).axes
    assert [len(ax.get_legend().get_texts()) for ax in (bars, scatter, lines)] == [2, 3, 4]


def test_a_lone_plan_is_plotted_next_to_its_baselines(plans, tmp_path):
    """With one plan, the report's own random and ISF packings of its samples join the plots:
    every bar panel has three bars; without them the plan-only panels are left out."""
    page = tmp_path / "report.html"
    stdout = vlmshard("report", str(plans["balanced"]), "--html", str(page)).stdout
    assert "random (baseline), isf (baseline) in the plots: the baselines above" in stdout
    assert ("baselines: the report's own random and isf packings of balanced's 600 samples"
            in stdout)
    parsed = _Page()
    parsed.feed(page.read_text(encoding="utf-8"))
    assert len([t for t, _ in parsed.tags if t == "img"]) == FIGURES - 1  # no training run
    own = plan_series("balanced", *load_plan(str(plans["balanced"])))
    other = plan_series("random", *load_plan(str(plans["random"])))
    figures = plots.report_figures([own, other])
    for ax in figures[0][0].axes:
        if ax.get_visible():
            assert len(ax.patches) == 2
    alone = [fig.get_suptitle() for fig, _ in plots.report_figures([own])]
    assert not any("side by side" in t or "fill" in t for t in alone) and len(alone) == 3


def test_a_log_of_the_warm_up_step_alone_is_noted_not_compared(plans, tmp_path):
    """`vlmshard run` with max_steps 1 still gets its report: the log holds the warm-up step
    alone, which the comparison leaves out, and the report says so."""
    log = tmp_path / "train_log.jsonl"
    write_train_log(plans["balanced"], log, dp=4, steps=1)
    result, text = make_report([str(plans["balanced"])], train_log=str(log))
    assert "train_log" not in result and "Training run" not in result["summary"]["text"]
    assert f"{log}: only the warm-up step was logged" in text
