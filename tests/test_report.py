"""vlmshard report: the table holds plan.json's metrics with a column per plan, the per-step series
average to those metrics, a training log is checked against its plan and set against the plan's
predicted waiting, the HTML page is self-contained and a browser shows every plot."""

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
from vlmshard.report.report import load_plan, plan_labels
from vlmshard.report.series import (PlanSeries, TrainSeries, plan_series,
                            train_series)
from vlmshard.packing.stats import load_stats
from vlmshard.model_sizes import PRESETS, training_flops
from vlmshard.train.train_log import parse_log, rank_data, rank_timing, step_record, write_record

from helpers import vlmshard

META = os.path.join(os.path.dirname(__file__), "data", "omnibal", "meta.json")
ROWS = ["step_efficiency", "pad_ratio", "vit_dist_ratio", "llm_dist_ratio", "attn_dist_ratio", "vit_fill",
        "llm_fill", "cost_efficiency", "order_spearman", "source_mix_tv", "steps",
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
    """[plan steps, dp] each DP rank's cost (a_v·tiles + a_t·tokens + b·Σlen²) at each plan step,
    computed here from plan.parquet, the OmniBal files and plan.json's cost model."""
    info = json.loads((plan_dir / "plan.json").read_text())
    tiles, tokens = _omnibal_lengths()
    a_v, a_t, b = (info["cost_model"][k] for k in ("a_v", "a_t", "b"))
    ranks, steps = info["params"]["ranks"], info["metrics"]["steps"]
    cost = np.zeros((steps, dp))
    for (step, rank, _), ids in _micro_batches(plan_dir).items():
        t = tokens[ids].astype(float)
        cost[step, rank // (ranks // dp)] += a_v * tiles[ids].sum() + a_t * t.sum() + b * (t ** 2).sum()
    return cost


def _expected_waits(plan_dir: Path, dp: int) -> np.ndarray:
    """[steps, dp] the share of each plan step a DP rank would wait if its time were its cost."""
    cost = _rank_costs(plan_dir, dp)
    return 1 - cost / cost.max(axis=1, keepdims=True)


BUBBLE_S = 0.1  # the synthetic run's pipeline bubble: every rank waits at least this long


def _compute_seconds(plan_dir: Path, dp: int, pp: int, steps: int) -> np.ndarray:
    """[steps, pp, dp] the synthetic run's compute time of each rank: its DP rank's cost, scaled
    to at most 0.5 s, times a fixed pseudo-random factor in [0.9, 1.1] per rank and step (so
    measured waiting is not the plan's prediction in disguise)."""
    cost = _rank_costs(plan_dir, dp)
    cost = cost[np.arange(steps) % len(cost)]
    jitter = np.random.default_rng(0).uniform(0.9, 1.1, (steps, pp, dp))
    return 0.5 * cost[:, None, :] / cost.max() * jitter


def _loader_batch(plan_step: int, ids: list[int], tiles: np.ndarray, tokens: np.ndarray) -> dict:
    """The fields of a loader micro-batch that the trainer's log records read."""
    lens = tokens[ids]
    return {"step": plan_step, "sample_ids": np.array(ids, np.int64),
            "num_tokens": int(lens.sum()), "num_tiles": int(tiles[ids].sum()),
            "num_samples": len(ids), "cu_seqlens": np.r_[0, np.cumsum(lens)]}


def write_train_log(plan_dir: Path, path: Path, dp: int, pp: int = 2,
                    steps: int = TRAIN_STEPS) -> None:
    """A train_log.jsonl for a run on ``plan_dir``'s shards with ``dp`` × ``pp`` ranks, made by
    the trainer's own record functions (vlmshard.train.train_log). Each DP rank trains its virtual
    ranks' micro-batches of the plan (from plan step 0 again after the last); rank (stage, d)
    computes for ``_compute_seconds`` (forward 1/3, backward 2/3) and the step lasts the slowest
    rank's compute plus ``BUBBLE_S``."""
    info = json.loads((plan_dir / "plan.json").read_text())
    ranks, micro = info["params"]["ranks"], info["params"]["micro_batches"]
    plan_steps = info["metrics"]["steps"]
    batches = _micro_batches(plan_dir)
    tiles, tokens = _omnibal_lengths()
    compute = _compute_seconds(plan_dir, dp, pp, steps)
    flops = training_flops(PRESETS["internvl2-2b"])
    per_dp = ranks // dp
    with open(path, "w", encoding="utf-8") as f:
        for step in range(steps):
            s = step % plan_steps
            seconds = compute[step].max() + BUBBLE_S
            timings = []
            for stage in range(pp):
                for d in range(dp):
                    c = float(compute[step, stage, d])
                    timing = rank_timing(rank=stage * dp + d, stage=stage, dp_rank=d,
                                         forward_s=c / 3, backward_s=2 * c / 3,
                                         step_time_s=float(seconds))
                    if stage == 0:
                        timing["data"] = rank_data(
                            [_loader_batch(s, batches[(s, v, m)], tiles, tokens)
                             for v in range(d * per_dp, (d + 1) * per_dp) for m in range(micro)])
                    timings.append(timing)
            write_record(f, step_record(step, 2.0, timings, flops))


@pytest.fixture(scope="module")
def report_run(plans, tmp_path_factory) -> dict:
    """One ``vlmshard report balanced random --train-log --html --json``, as a user runs it."""
    out = tmp_path_factory.mktemp("report")
    write_train_log(plans["balanced"], out / "train_log.jsonl", dp=4)
    proc = vlmshard("report", str(plans["balanced"]), str(plans["random"]), "--train-log",
                    str(out / "train_log.jsonl"), "--html", str(out / "report.html"), "--json",
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


def test_json_dash_prints_what_json_path_writes(plans, tmp_path):
    path = tmp_path / "r.json"
    proc = vlmshard("report", str(plans["random"]), "--json", str(path))
    assert proc.stdout.splitlines()[0].startswith("random: the ranks spend")
    assert proc.stdout.splitlines()[2].split() == ["metric", "random"]
    printed = vlmshard("report", str(plans["random"]), "--json", "-").stdout
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

def _measured_waits(plan_dir: Path, dp: int, pp: int, steps: int) -> np.ndarray:
    """[steps, pp·dp] each rank's waiting share of the synthetic run, from the compute times the
    log was made from (not from the log): (step time − own compute) / step time."""
    compute = _compute_seconds(plan_dir, dp, pp, steps)
    step_time = compute.max(axis=(1, 2)) + BUBBLE_S
    return (1 - compute / step_time[:, None, None]).reshape(steps, pp * dp)


def test_train_log_is_set_against_the_plans_prediction(plans, report_run):
    summary = json.loads(report_run["json"].read_text())["train_log"]
    want = _expected_waits(plans["balanced"], 4)
    predicted = want.mean(axis=1)[np.arange(TRAIN_STEPS) % len(want)]
    measured = _measured_waits(plans["balanced"], 4, 2, TRAIN_STEPS).mean(axis=1)
    assert summary["plan"] == "balanced" and summary["steps"] == TRAIN_STEPS
    assert summary["dp"] == 4
    assert summary["predicted_wait_mean"] == pytest.approx(predicted.mean(), rel=1e-9)
    assert summary["measured_wait_mean"] == pytest.approx(measured.mean(), rel=1e-9)
    assert summary["correlation"] == pytest.approx(np.corrcoef(predicted, measured)[0, 1],
                                                   rel=1e-9)
    # the run's bubble and jitter make measured waiting more than predicted, as in a real run
    assert summary["measured_wait_mean"] > summary["predicted_wait_mean"] + 0.05
    assert f"correlation per step {summary['correlation']:.3f}" in report_run["stdout"]


@pytest.mark.parametrize("dp", [4, 2])
def test_train_series_per_step_and_rank(plans, tmp_path, dp):
    """The random plan has 4 ranks; a run with dp=2 trains 2 virtual ranks per DP rank."""
    log = tmp_path / "train_log.jsonl"
    write_train_log(plans["random"], log, dp=dp, pp=2, steps=20)
    info, packing, lengths = load_plan(str(plans["random"]))
    with open(log) as f:
        train = train_series(parse_log(f, str(log)), str(log), packing, lengths,
                             CostModel(**info["cost_model"]))
    waits = _expected_waits(plans["random"], dp)[:20]
    assert train.steps.tolist() == list(range(20)) and train.dp == dp
    assert train.predicted == pytest.approx(waits.mean(axis=1))
    # [step, rank] by global rank: stage 0's DP ranks, then stage 1's
    assert train.measured == pytest.approx(_measured_waits(plans["random"], dp, 2, 20))
    assert train.ranks[dp] == f"rank {dp} (stage 1, dp 0)"


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
    for _, attrs in page.tags:  # nothing is fetched from anywhere
        for key in ("src", "href"):
            assert not attrs.get(key) or attrs[key].startswith("data:image/png;base64,")
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
    assert [r[0] for r in page.rows[1:]] == ROWS
    assert page.rows[1 + ROWS.index("llm_dist_ratio")][1:] == [
        format_value(_metrics(plans[a])["llm_dist_ratio"]) for a in ("balanced", "random")]


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


def test_many_sources_and_ranks_keep_the_legends_short():
    """Twelve sources fold into the 8 largest plus "other"; 16 ranks share one legend entry."""
    rng = np.random.default_rng(0)
    steps, dp, n_sources = 30, 16, 12
    counts = rng.integers(0, 5, (steps, n_sources)) + np.arange(n_sources)  # larger ids, larger
    metrics = {key: 0.5 for key, _ in plots.COMPARED}
    series = PlanSeries("x", metrics, *rng.random((3, steps)), rng.random(80), rng.random(80),
                        rng.random((steps, dp)), counts / counts.sum(axis=1, keepdims=True),
                        tuple(f"s{i}" for i in range(n_sources)))
    legend = plots.source_mix_figure([series]).axes[0].get_legend()
    names = [t.get_text() for t in legend.get_texts()]
    assert names == [f"s{i}" for i in range(4, 12)] + ["other"]
    train = TrainSeries(np.arange(steps), rng.random(steps), rng.random((steps, dp)),
                        tuple(f"rank {r}" for r in range(dp)), dp)
    for ax in plots.train_figure(train, "x").axes:
        assert len(ax.get_legend().get_texts()) == 2  # each rank, and the reference
