"""``vlmshard report``: the balance metrics of one or more plans side by side (DESIGN.md's
definitions), as a terminal table, JSON and a self-contained HTML page of plots, optionally set
against a training run's measured waiting times. The IO of the report lives here; the
series (``series``), figures (``plots``) and page (``html_report``) are pure."""

from __future__ import annotations

import logging
import os
import tempfile

from vlmshard.io import atomic_write, write_json_atomic
from vlmshard.packing.batches import Lengths, Packing
from vlmshard.packing.cost import CostModel
from vlmshard.packing.metrics import REPORT_KEYS, format_value
from vlmshard.packing.plan import load_plan, plan_stats_path, read_plan_json

from vlmshard.train.train_log import read_numbered

from .series import PlanSeries, TrainSeries, plan_series, train_series

log = logging.getLogger(__name__)

# The table's rows: the metrics pack prints, and the source-mix distance next to order_spearman.
_AFTER = REPORT_KEYS.index("order_spearman") + 1
ROWS = REPORT_KEYS[:_AFTER] + ("source_mix_tv",) + REPORT_KEYS[_AFTER:]

def plan_labels(plan_dirs: list[str], infos: list[dict]) -> list[str]:
    """Column headers: the algorithms when they differ, else folder names, else the paths."""
    for labels in ([i["algorithm"] for i in infos],
                   [os.path.basename(os.path.normpath(d)) for d in plan_dirs]):
        if len(set(labels)) == len(labels):
            return labels
    return list(plan_dirs)


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """Rows of strings as aligned text: the first column left-aligned, the rest right-aligned."""
    table = [header] + rows
    widths = [max(len(r[c]) for r in table) for c in range(len(header))]
    return "\n".join("  ".join([r[0].ljust(widths[0])] + [v.rjust(w) for v, w in
                                                           zip(r[1:], widths[1:])]).rstrip()
                     for r in table)


BASELINES = ("random", "isf")  # what a plan's summary is compared with


def baseline_efficiencies(plan_dir: str, info: dict) -> dict[str, float]:
    """The step_efficiency of ``random`` and ``isf`` packings of the plan's own stats, with its
    DP, micro-batches, seed, compute mode and cost model (each with its own caps): the packings
    a user would otherwise train on, so one plan is always compared with something."""
    from vlmshard.packing.config import PackConfig
    from vlmshard.packing.plan import run_pack

    params, stats = info["params"], plan_stats_path(info, plan_dir)
    out = {}
    quiet = logging.getLogger("vlmshard.packing")  # these packings are the report's own
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        with tempfile.TemporaryDirectory(prefix="vlmshard-report-") as tmp:
            cost = os.path.join(tmp, "cost_model.json")
            write_json_atomic(cost, info["cost_model"])
            for algo in BASELINES:
                if algo == info["algorithm"]:
                    continue
                result = run_pack(PackConfig(
                    stats=stats, dp=params["dp"], virtual_ranks=params["ranks"],
                    micro_batches=params["micro_batches"], algo=algo, seed=params["seed"],
                    epochs=params["epochs"], target_samples=params["target_samples"],
                    compute_mode=params.get("compute_mode", "padding-free"), cost_model=cost,
                    out=os.path.join(tmp, algo)))
                out[algo] = result.metrics.step_efficiency
    finally:
        quiet.setLevel(level)
    return out


def summary_line(label: str, info: dict, baselines: dict[str, float]) -> str:
    """The report's opening sentence, in plain words."""
    efficiency = info["metrics"]["step_efficiency"]
    mode = info["params"].get("compute_mode", "padding-free")
    text = (f"{label}: the ranks spend {100 * efficiency:.1f}% of their time on useful work "
            f"(step_efficiency {efficiency:.4f}, {mode} compute, {info['params']['dp']} DP "
            "ranks).")
    if baselines:
        text += " Predicted speed: " + ", ".join(
            f"{efficiency / e:.2f}x that of {algo} packing" for algo, e in baselines.items()) + \
            " of the same samples."
    return text


def read_train_log(path: str, info: dict, packing: Packing, lengths: Lengths) -> TrainSeries:
    return train_series(read_numbered(path), path, packing, lengths, CostModel(**info["cost_model"]))


def make_report(plan_dirs: list[str], train_log: str | None = None, html: str | None = None,
                json: str | None = None) -> tuple[dict, str]:
    """The report as JSON and as the terminal table; writes the ``html`` and ``json`` files
    when asked."""
    infos = [read_plan_json(d) for d in plan_dirs]
    labels = plan_labels(plan_dirs, infos)
    header = ["metric", *labels]
    rows = [[k, *(format_value(i["metrics"][k]) for i in infos)] for k in ROWS]
    loaded = {}  # plan dir -> (info, packing, lengths), read only when a plot or the log needs it
    if html or train_log:
        for d in plan_dirs if html else plan_dirs[:1]:
            loaded[d] = load_plan(d)
    train = (read_train_log(train_log, *loaded[plan_dirs[0]])
             if train_log else None)
    result = {"plans": [{"label": label, "plan_dir": d, "algorithm": i["algorithm"],
                         "metrics": {k: i["metrics"][k] for k in ROWS}}
                        for label, d, i in zip(labels, plan_dirs, infos)]}
    try:
        baselines = baseline_efficiencies(plan_dirs[0], infos[0])
    except (FileNotFoundError, ValueError) as e:  # the stats are not here
        log.warning("no comparison with other packings: %s", e)
        baselines = {}
    headline = summary_line(labels[0], infos[0], baselines)
    result["summary"] = {"plan": labels[0], "text": headline,
                         "step_efficiency": infos[0]["metrics"]["step_efficiency"],
                         "baseline_step_efficiency": baselines}
    notes = [f"{label}: {d}" for label, d in zip(labels, plan_dirs)]
    if train is not None:
        summary = train.summary()
        result["train_log"] = {"path": train_log, "plan": labels[0], **summary}
        notes.append(
            f"{train_log} ({summary['steps']} steps on {labels[0]}, dp {summary['dp']}): "
            f"waiting fraction predicted by the plan {summary['predicted_wait_mean']:.4f}, "
            f"measured {summary['measured_wait_mean']:.4f} (mean over ranks and steps), "
            f"correlation per step {summary['correlation']:.3f}")
    if html:
        from . import html_report, plots  # matplotlib only when a page is asked for

        series: list[PlanSeries] = [plan_series(label, *loaded[d])
                                    for label, d in zip(labels, plan_dirs)]
        page = html_report.render("vlmshard report", headline, notes, header, rows,
                                  plots.report_figures(series, train, labels[0]))
        atomic_write(html, lambda tmp: _write_text(tmp, page))
        log.info("report written to %s", html)
    if json:
        write_json_atomic(json, result)
        log.info("JSON written to %s", json)
    return result, "\n".join([headline, "", format_table(header, rows), *notes])


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
