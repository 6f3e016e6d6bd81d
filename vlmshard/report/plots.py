"""The figures of ``vlmshard report --html``: pure functions from series to matplotlib Figures.

Figures are built with ``matplotlib.figure.Figure`` (no pyplot, so no global state and no GUI
backend); ``vlmshard.report.html_report`` renders them with Agg. Each figure has a title, labelled axes
and a caption (``report_figures``) that says how to read it.
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from .series import PlanSeries, TrainSeries

WIDTH = 10.0  # inches; at 100 dpi a figure is 1000 px wide
ROW_HEIGHT = 2.6
MAX_SOURCES = 9  # the source-mix plot folds smaller sources into "other"
MAX_RANK_LEGEND = 8  # more ranks than this share one legend entry

# The metrics the comparison plot shows, with which way is better.
COMPARED = (("pad_ratio", "lower is better"), ("vit_dist_ratio", "lower is better"),
            ("llm_dist_ratio", "lower is better"), ("attn_dist_ratio", "lower is better"),
            ("vit_fill", "higher is better"), ("llm_fill", "higher is better"),
            ("cost_efficiency", "higher is better"), ("order_spearman", "near 0 is better"),
            ("source_mix_tv", "lower is better"))


def _rows(plans: list[PlanSeries], title: str) -> tuple[Figure, list]:
    """A figure with one row of axes per plan, sharing the x axis."""
    fig = Figure(figsize=(WIDTH, 0.6 + ROW_HEIGHT * len(plans)), layout="constrained")
    axes = fig.subplots(len(plans), 1, squeeze=False, sharex=True)[:, 0]
    fig.suptitle(title)
    return fig, list(axes)


def imbalance_figure(plans: list[PlanSeries]) -> Figure:
    fig, axes = _rows(plans, "Per-step imbalance over the epoch (dist ratio, 0 = all ranks equal)")
    for ax, p in zip(axes, plans):
        steps = np.arange(len(p.vit_imbalance))
        for series, name in ((p.vit_imbalance, "ViT (Σtiles)"), (p.llm_imbalance, "LLM (Σtokens)"),
                             (p.attn_imbalance, "attention (Σseq_len²)")):
            ax.plot(steps, series, lw=0.9, label=f"{name}, mean {series.mean():.4f}")
        ax.set_title(p.label, loc="left", fontsize="medium")
        ax.set_ylabel("dist ratio")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize="small", loc="upper right")
    axes[-1].set_xlabel("step")
    return fig


def fill_figure(plans: list[PlanSeries]) -> Figure:
    fig = Figure(figsize=(WIDTH, 3.6), layout="constrained")
    fig.suptitle("Micro-batch fill: how full each micro-batch is of its caps")
    bins = np.linspace(0.0, 1.0, 26)
    for ax, attr, xlabel in zip(fig.subplots(1, 2), ("tile_fill", "token_fill"),
                                ("ViT fill: Σtiles / Qv", "LLM fill: Σseq_len / Qt")):
        for p in plans:
            values = getattr(p, attr)
            ax.hist(values, bins=bins, histtype="step", lw=1.5,
                    label=f"{p.label}, mean {values.mean():.3f}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("micro-batches")
        ax.legend(fontsize="small", loc="upper left")
    return fig


def cumulative_load_figure(plans: list[PlanSeries]) -> Figure:
    fig, axes = _rows(plans, "Per-rank cumulative load (cost model) over the epoch")
    for ax, p in zip(axes, plans):
        steps = np.arange(1, len(p.rank_cost) + 1)
        synchronous = np.cumsum(p.rank_cost.max(axis=1))
        # One power of ten in the label, not matplotlib's offset text over the subplot title.
        exponent = int(np.floor(np.log10(synchronous[-1]))) if len(steps) and synchronous[-1] > 0 \
            else 0
        scale = 10.0 ** exponent
        for r, line in enumerate(np.cumsum(p.rank_cost, axis=0).T):
            ax.plot(steps, line / scale, lw=0.8, alpha=0.8, label="each rank" if r == 0 else None)
        ax.plot(steps, synchronous / scale, "k--", lw=1.2,
                label="Σ slowest rank (step-synchronous time)")
        ax.set_title(f"{p.label}: {p.rank_cost.shape[1]} ranks", loc="left", fontsize="medium")
        ax.set_ylabel(f"cumulative cost (×1e{exponent})")
        ax.legend(fontsize="small", loc="upper left")
    axes[-1].set_xlabel("step")
    return fig


def _top_sources(p: PlanSeries) -> tuple[np.ndarray, list[str]]:
    """The step shares of the largest sources, the rest summed as "other"."""
    if len(p.sources) <= MAX_SOURCES:
        return p.source_shares.T, list(p.sources)
    keep = np.sort(np.argsort(-p.source_shares.sum(axis=0), kind="stable")[:MAX_SOURCES - 1])
    rest = np.ones(len(p.sources), bool)
    rest[keep] = False
    shares = np.vstack([p.source_shares[:, keep].T, p.source_shares[:, rest].sum(axis=1)])
    return shares, [p.sources[i] for i in keep] + ["other"]


def source_mix_figure(plans: list[PlanSeries]) -> Figure:
    fig, axes = _rows(plans, "Source mix over steps (share of each step's samples)")
    for ax, p in zip(axes, plans):
        shares, names = _top_sources(p)
        ax.stackplot(np.arange(len(p.source_shares)), shares, labels=names, alpha=0.85)
        ax.set_title(f"{p.label}: source_mix_tv {p.metrics['source_mix_tv']:.4f}", loc="left",
                     fontsize="medium")
        ax.set_ylabel("share of samples")
        ax.set_ylim(0, 1)
        ax.margins(x=0)
        ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.0, 0.5))
    axes[-1].set_xlabel("step")
    return fig


def comparison_figure(plans: list[PlanSeries]) -> Figure:
    cols = 3
    rows = -(-len(COMPARED) // cols)
    fig = Figure(figsize=(WIDTH, 0.6 + 2.4 * rows), layout="constrained")
    fig.suptitle("Plans side by side: one bar per plan for each metric")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    colors = [f"C{i}" for i in range(len(plans))]
    labels = [p.label for p in plans]
    for ax, (key, better) in zip(axes, COMPARED):
        values = [p.metrics[key] for p in plans]
        bars = ax.bar(labels, values, color=colors)
        ax.bar_label(bars, fmt="%.3f", fontsize="small")
        ax.set_title(f"{key} ({better})", fontsize="medium")
        ax.set_ylabel(key)
        ax.set_xlabel("plan")
        ax.margins(y=0.2)
        ax.axhline(0, color="k", lw=0.6)
    for ax in axes[len(COMPARED):]:
        ax.set_visible(False)
    return fig


def train_figure(train: TrainSeries, plan_label: str) -> Figure:
    fig = Figure(figsize=(WIDTH, 4.0), layout="constrained")
    fig.suptitle(f"Measured waiting vs the plan's predicted imbalance ({plan_label}, "
                 f"{train.dp} DP rank(s))")
    scatter, lines = fig.subplots(1, 2)
    names = (list(train.ranks) if len(train.ranks) <= MAX_RANK_LEGEND
             else ["each rank"] + [None] * (len(train.ranks) - 1))
    for r, name in enumerate(names):
        scatter.scatter(train.predicted, train.measured[:, r], s=12, alpha=0.7, label=name)
    top = max(float(train.predicted.max()), float(train.measured.max()), 1e-3) * 1.05
    scatter.plot([0, top], [0, top], "k:", lw=1, label="measured = predicted")
    scatter.set_xlabel("predicted waiting fraction (1 − mean C / max C)")
    scatter.set_ylabel("measured wait_s / step_time_s")
    scatter.set_title("one point per rank per step", fontsize="medium")
    scatter.legend(fontsize="x-small", loc="upper left")
    for r, name in enumerate(names):
        lines.plot(train.steps, train.measured[:, r], lw=0.8, alpha=0.8, label=name)
    lines.plot(train.steps, train.predicted, "k-", lw=2, label="predicted (plan)")
    lines.set_xlabel("training step")
    lines.set_ylabel("waiting fraction of the step")
    lines.set_title("per step", fontsize="medium")
    lines.set_ylim(bottom=0)
    lines.legend(fontsize="x-small", loc="upper right")
    return fig


def report_figures(plans: list[PlanSeries], train: TrainSeries | None = None,
                   train_plan: str = "") -> list[tuple[Figure, str]]:
    """Every figure of the report with its caption, in page order."""
    figures = [
        (comparison_figure(plans),
         "Each panel is one metric of DESIGN.md with one bar per plan; the panel title says "
         "which way is better."),
        (imbalance_figure(plans),
         "For each step, the share of the step that ranks would wait on the busiest rank's "
         "tiles, tokens or attention work; the means are the plan's dist ratios. Flat near 0 is "
         "balanced; spikes are unbalanced steps."),
        (fill_figure(plans),
         "Histograms over micro-batches of Σtiles / Qv and Σseq_len / Qt: mass near 1 means "
         "full micro-batches; mass to the left is padding paid for by every micro-batch."),
        (cumulative_load_figure(plans),
         "Each rank's cost summed over the steps; the dashed line sums the slowest rank of each "
         "step, which is the time a step-synchronous run takes. The gap between a rank's line "
         "and the dashed line is that rank's accumulated waiting."),
        (source_mix_figure(plans),
         "The share of each source among a step's samples (largest sources, the rest as "
         "'other'): level bands mean every step mirrors the dataset's mix; bands that drift mean "
         "the plan reorders the data by source."),
    ]
    if train is not None:
        figures.append((train_figure(train, train_plan),
                        "Left: each rank's measured waiting fraction (wait_s / step_time_s) "
                        "against the waiting the plan's cost model predicts for that step; points "
                        "on the dotted line mean the plan's prediction held. Right: the same over "
                        "training steps, the plan's prediction in black."))
    return figures
