"""``vlmshard report``: the balance metrics of one or more plans side by side (``docs/design.md``,
"Metrics"), as a terminal table, JSON and a self-contained HTML page of plots, next to random
and ISF packings of the same samples, optionally with a training run's measured pipeline bubble
and data-parallel waiting set against the simulator's replay of that run. The IO of the report
lives here; the series (``series``), figures (``plots``) and page (``html_report``) are pure."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from vlmshard.errors import InputError
from vlmshard.io import atomic_write, file_in, folder_of, write_json_atomic
from vlmshard.packing.batches import Lengths, Packing
from vlmshard.packing.config import PADDED
from vlmshard.packing.cost import CostModel
from vlmshard.packing.groups import is_grouped
from vlmshard.packing.metrics import REPORT_KEYS, format_value, measure
from vlmshard.packing.plan import load_plan, read_plan_json, repack
from vlmshard.run_log import LOG_NAME, PIPELINE_NAME, read_numbered
from vlmshard.simulate.replay import Replay, compare, replay_run
from vlmshard.stage import Result

from .config import ReportConfig
from .series import PlanSeries, ReportError, check_train_log, plan_series

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


BASELINES = ("random", "isf")  # what a plan is compared with


def baseline_plans(info: dict, lengths: Lengths) -> dict[str, tuple[dict, Packing]]:
    """``random`` and ``isf`` packings of exactly the plan's samples (``packing.plan.repack``:
    its DP, micro-batches, seed, compute mode and cost model; each algorithm's own caps, raised
    where they would leave one of the samples out), as a plan.json-like dict (their metrics,
    caps and the caps their algorithm chose) and a packing: what a user would otherwise train
    on, so that one plan is always compared with something, over equal samples. A baseline
    that makes no whole step is left out, with a warning that names it."""
    params = info["params"]
    mode = params.get("compute_mode", "padding-free")
    out = {}
    for algo in BASELINES:
        if algo == info["algorithm"]:
            continue
        packed = repack(info, lengths, algo, mode)
        if not packed.packing.steps:
            log.warning("the report's %s baseline makes no whole step of the plan's %d samples: "
                        "no comparison with it", algo, len(packed.samples))
            continue
        metrics = measure(lengths, packed.packing, qv=packed.caps.qv, qt=packed.caps.qt,
                          cost=CostModel(**info["cost_model"]), padded=algo in PADDED,
                          dp=params["dp"], pack_seconds=0.0, mode=mode)
        out[algo] = ({"algorithm": algo, "params": params, "cost_model": info["cost_model"],
                      "metrics": metrics.to_dict(), "plan_samples": len(packed.samples),
                      "chosen_caps": {"qv": packed.chosen.qv, "qt": packed.chosen.qt}},
                     packed.packing)
    return out


def baseline_notes(label: str, baselines: dict[str, tuple[dict, Packing]]) -> list[str]:
    """What the baselines are, in the report's notes: whose samples, and caps raised."""
    if not baselines:
        return []
    first = next(iter(baselines.values()))[0]
    notes = [f"baselines: the report's own {' and '.join(baselines)} packings of {label}'s "
             f"{first['plan_samples']} samples, with its DP size, micro-batches, seed, compute "
             "mode and cost model (samples that fill no whole step wait for the next epoch, "
             "as in the plan)"]
    for algo, (b, _) in baselines.items():
        chosen, m = b["chosen_caps"], b["metrics"]
        if (chosen["qv"], chosen["qt"]) != (m["qv"], m["qt"]):
            notes.append(f"{algo} baseline: its own caps (Qv {chosen['qv']}, Qt "
                         f"{chosen['qt']}) would leave some of them out; packed under Qv "
                         f"{m['qv']}, Qt {m['qt']}")
    return notes


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


def train_sentence(c: dict) -> str:
    """The training run in the summary: measured against predicted, the two that matter."""
    return (f"Training run ({c['steps']} steps after warm-up, PP {c['pp']}, DP {c['dp']}; "
            f"predicted by the simulator's replay of its micro-batches): pipeline bubble "
            f"measured {c['bubble']['measured']:.3f} (predicted {c['bubble']['predicted']:.3f}), "
            f"DP waiting measured {c['dp_waiting']['measured']:.3f} (predicted "
            f"{c['dp_waiting']['predicted']:.3f}).")


GROUP_COLUMNS = (("length", "length"), ("sp", "sp"), ("qv", "qv"), ("dp", "dp"),
                 ("steps", "steps"), ("samples", "samples"), ("tokens", "tokens"),
                 ("attn_dist_ratio", "ABR"), ("communication_ratio", "CR"),
                 ("llm_fill", "llm_fill"), ("vit_fill", "vit_fill"),
                 ("step_efficiency", "step_efficiency"),
                 ("vit_rank_balance", "ViT max/mean rank"),
                 ("llm_rank_balance", "LLM max/mean rank"))


def group_table(label: str, info: dict) -> tuple[list[str], list[str], list[list[str]]]:
    """A grouped plan's packing groups (``vlmshard pack --groups``): each one's caps, SP
    degree, data-parallel ranks and figures, as notes and a table."""
    notes = [f"{label}: packing groups (docs/groups.md); ABR is attn_dist_ratio, CR the share "
             f"of tokens that pay the sequence-parallel exchange (the plan's: "
             f"{info['metrics']['communication_ratio']:.4f}); max/mean rank: a group's fullest "
             f"SP rank over the mean, summed over its micro-batches (1: even; the ViT's as "
             f"its images and video steps are dealt, '-' without media sizes)"]
    rows = [[f"group {g}", *(format_value(group[key]) for key, _ in GROUP_COLUMNS)]
            for g, group in enumerate(info["groups"])]
    return notes, [label, *(name for _, name in GROUP_COLUMNS)], rows


COEFFICIENTS = ("a_v", "a_vs", "a_t", "b", "a_s")


def cost_table(labels: list[str], infos: list[dict],
               refit: CostModel | None) -> tuple[list[str], list[str], list[list[str]]]:
    """Each plan's cost model (plan.json's) and, with a run, the one refit from its log
    (``CostModel.from_run``), as notes and a table: the coefficients in their own units, then
    the ratios to a_t that balance weighs, unit-free, and a refit's rows and error."""
    models = [(label, CostModel(**i["cost_model"]).to_dict())  # an older plan's defaults
              for label, i in zip(labels, infos)]
    if refit is not None:
        models.append(("refit from the run", refit.to_dict()))

    def per_token(m: dict, k: str) -> str:
        return f"{m[k] / m['a_t']:.4g}" if m["a_t"] else "-"

    rows = [["origin", *(m["origin"] for _, m in models)]]
    rows += [[k, *(f"{m[k]:.4g}" for _, m in models)] for k in COEFFICIENTS]
    rows += [[f"{k} / a_t", *(per_token(m, k) for _, m in models)]
             for k in COEFFICIENTS if k != "a_t"]
    rows.append(["fit: rows, rms error", *(f"{m['fit']['rows']}, {m['fit']['rms_error']:.1%}"
                                           if m.get("fit") else "-" for _, m in models)])
    notes = ["cost models: a_v per tile, a_vs per tile² of an image or video step a ViT "
             "attends across (Qwen's), a_t per token, b per squared sequence length, a_s per "
             "supervised token, in FLOPs (origin flops:) or seconds (a profile's file:, a "
             "run's run:); the ratios to a_t are what balance weighs, in any unit. A "
             "run's refit: its logged sizes and part times per step and data-parallel rank, "
             "by non-negative least squares (docs/packing.md)"]
    return notes, ["cost model", *(name for name, _ in models)], rows


def refit_of(train_log: str) -> CostModel | None:
    """The cost model refit from the run whose log is ``train_log``; None, with a warning,
    for a log that times no parts of the model (one of an older vlmshard, or made by hand)."""
    try:
        return CostModel.from_run(os.path.dirname(train_log) or ".")
    except InputError as e:
        log.warning("no cost model refit from the run: %s", e)
        return None


TRAIN_HEADER = ["training run", "measured", "predicted", "per-step correlation",
                "per-step median abs error"]


def train_table(path: str, plan: str, c: dict) -> tuple[list[str], list[str], list[list[str]]]:
    """The training run in full, as notes and a table: where the prediction comes from, each
    stage's bubble, all stages', DP waiting, the unmodelled rest of the step and, with a
    profile, the step times."""
    notes = [f"{path}: {c['steps']} steps on {plan} (the first, warm-up, left out), PP {c['pp']}, "
             f"DP {c['dp']}. Measured: each rank's forward and backward time and its pipeline "
             "time (step start to the end of its last backward); a stage's bubble is 1 − its "
             "forward + backward over its replica's pipeline time, DP waiting the replicas' "
             "idle share until the slowest replica's pipeline ends. Predicted: each step's "
             "logged micro-batches replayed through 1F1B with the run's own stage partition and "
             f"{c['basis']}."]
    if "step_seconds" in c:
        t = c["step_seconds"]
        notes.append(f"Step time: predicted {t['predicted_s']:.2f} s, measured "
                     f"{t['measured_s']:.2f} s ({t['total_error']:+.1%}); median per-step error "
                     f"{t['median_step_error']:.1%}.")
    else:
        notes.append("Step time: not predicted (analytic FLOPs give shares of time, not seconds, "
                     "and no rate is fitted; --profile replays with measured layer times).")

    def row(name: str, entry: dict) -> list[str]:
        correlation = entry["correlation"]
        return [name, f"{entry['measured']:.3f}", f"{entry['predicted']:.3f}",
                "n/a" if correlation is None else f"{correlation:.3f}",
                f"{entry['median_abs_error']:.3f}"]

    rows = [row(f"bubble, stage {s['stage']} ({s['layers'][0]} .. {s['layers'][-1]})", s)
            for s in c["stage_bubble"]]
    rows += [row("bubble, all stages", c["bubble"]), row("DP waiting", c["dp_waiting"]),
             ["other (all-reduce, optimizer)", f"{c['other_measured']:.3f}", "not modelled",
              "", ""]]
    return notes, TRAIN_HEADER, rows


def read_train_run(path: str, profile: str | None,
                   packing: Packing) -> tuple[Replay, dict] | None:
    """The training log checked against its plan, replayed, and compared; None when it holds
    the warm-up step alone."""
    records = read_numbered(path)
    check_train_log(records, path, packing)
    if len(records) < 2:
        log.warning("%s: only the warm-up step: nothing to compare", path)
        return None
    try:
        replay = replay_run(path, profile)
    except KeyError as e:
        raise ReportError(f"{path}: a step, or the run's {PIPELINE_NAME}, lacks {e}") from e
    try:
        return replay, compare(replay)
    except (InputError, ValueError) as e:  # ours (no pipeline_s), or numpy's
        raise ReportError(f"{path}: {e}") from e


@dataclass
class ReportResult(Result):
    """The report: its JSON form, its terminal text (headline, tables) and the files written."""

    report: dict
    table: str
    html: str | None = None
    out_json: str | None = None

    def summary(self) -> str:
        written = ", ".join(p for p in (self.html, self.out_json) if p)
        return self.report["summary"]["text"] + (f" -> {written}" if written else "")

    def text(self) -> str:
        return self.table

    def to_json(self) -> dict:
        return self.report


def run_report(cfg: ReportConfig) -> ReportResult:
    """``vlmshard report``: the report of ``cfg.plan_dirs``, with the files it asks for (a
    run's folder for its ``train_log.jsonl``, a profile's ``profile.json`` for its folder)."""
    train_log = cfg.train_log and file_in(cfg.train_log, LOG_NAME, "--train-log")
    profile = cfg.profile and folder_of(cfg.profile, "profile.json", "--profile")
    report, table = make_report(cfg.plan_dirs, train_log=train_log, profile=profile,
                                html=cfg.html, out_json=cfg.out_json)
    return ReportResult(report, table, cfg.html, cfg.out_json)


def make_report(plan_dirs: list[str], train_log: str | None = None, profile: str | None = None,
                html: str | None = None, out_json: str | None = None) -> tuple[dict, str]:
    """The report as JSON and as the terminal table; writes the ``html`` and ``out_json``
    files when asked."""
    infos = [read_plan_json(d) for d in plan_dirs]
    for d, info in zip(plan_dirs, infos):
        lacking = [k for k in ("algorithm", "params") if k not in info] + \
            [k for k in ROWS if k not in info["metrics"]]
        if lacking:
            raise ReportError(f"{d}/plan.json lacks {', '.join(lacking)}: pack it again with "
                              "this vlmshard")
    labels = plan_labels(plan_dirs, infos)
    header = ["metric", *labels]
    rows = [[k, *(format_value(i["metrics"][k]) for i in infos)] for k in ROWS]
    loaded: dict[str, tuple[dict, Packing, Lengths]] = {}  # read when a plot or the log needs it
    if html or train_log:
        for d in plan_dirs if html else plan_dirs[:1]:
            loaded[d] = load_plan(d)
    train = read_train_run(train_log, profile, loaded[plan_dirs[0]][1]) if train_log else None
    result = {"plans": [{"label": label, "plan_dir": d, "algorithm": i["algorithm"],
                         "metrics": {k: i["metrics"][k] for k in ROWS}}
                        for label, d, i in zip(labels, plan_dirs, infos)]}
    grouped = [is_grouped(i.get("groups", [])) for i in infos]
    for entry, info, is_group in zip(result["plans"], infos, grouped):
        if is_group:
            entry["groups"] = info["groups"]
            entry["metrics"]["communication_ratio"] = info["metrics"]["communication_ratio"]
    baselines: dict[str, tuple[dict, Packing]] = {}
    if not grouped[0]:  # one-cap packings of a grouped plan's samples compare with one cap
        try:
            if plan_dirs[0] not in loaded:
                loaded[plan_dirs[0]] = load_plan(plan_dirs[0])
            baselines = baseline_plans(infos[0], loaded[plan_dirs[0]][2])
        except (FileNotFoundError, InputError) as e:  # the stats are not here, or changed
            log.warning("no comparison with other packings: %s", e)
    efficiencies = {algo: i["metrics"]["step_efficiency"] for algo, (i, _) in baselines.items()}
    result["baselines"] = {algo: {"metrics": {k: i["metrics"][k] for k in ROWS},
                                  "plan_samples": i["plan_samples"],
                                  "chosen_caps": i["chosen_caps"]}
                           for algo, (i, _) in baselines.items()}
    headline = summary_line(labels[0], infos[0], efficiencies)
    notes = [f"{label}: {d}" for label, d in zip(labels, plan_dirs)]
    notes += baseline_notes(labels[0], baselines)
    tables = [(notes, header, rows)]
    tables += [group_table(label, info) for label, info, is_group in zip(labels, infos, grouped)
               if is_group]
    refit = refit_of(train_log) if train_log else None
    tables.append(cost_table(labels, infos, refit))
    result["cost_models"] = {label: i["cost_model"] for label, i in zip(labels, infos)}
    if refit is not None:
        result["cost_models"]["refit"] = refit.to_dict()
    if train_log and train is None:
        notes.append(f"{train_log}: only the warm-up step was logged, which the comparison "
                     "with the simulator leaves out: train two steps or more")
    if train is not None:
        comparison = train[1]
        headline += " " + train_sentence(comparison)
        result["train_log"] = {"path": train_log, "plan": labels[0], **comparison}
        tables.append(train_table(train_log, labels[0], comparison))
    result["summary"] = {"plan": labels[0], "text": headline,
                         "step_efficiency": infos[0]["metrics"]["step_efficiency"],
                         "baseline_step_efficiency": efficiencies}
    if html:
        series = [plan_series(label, *loaded[d]) for label, d in zip(labels, plan_dirs)]
        given = {i["algorithm"] for i in infos}
        shown = [(f"{algo} (baseline)", *plan) for algo, plan in baselines.items()
                 if algo not in given]
        series += [plan_series(label, info, packing, loaded[plan_dirs[0]][2])
                   for label, info, packing in shown]
        if shown:
            notes.append(f"{', '.join(label for label, _, _ in shown)} in the plots: the "
                         "baselines above")
        _write_html(html, headline, tables, series, train[0] if train else None)
    if out_json:
        write_json_atomic(out_json, result)
        log.info("JSON written to %s", out_json)
    text = [headline]
    for table_notes, table_header, table_rows in tables:
        text += ["", format_table(table_header, table_rows), *table_notes]
    return result, "\n".join(text)


def _write_html(path: str, headline: str, tables: list, series: list[PlanSeries],
                train_series) -> None:
    from . import html_report, plots  # matplotlib only when a page is asked for

    page = html_report.render("vlmshard report", headline,
                              [html_report.Table(*t) for t in tables],
                              plots.report_figures(series, train_series))
    atomic_write(path, lambda tmp: _write_text(tmp, page))
    log.info("report written to %s", path)


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
