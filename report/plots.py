"""The figures of ``vlmshard report --html``: pure functions from series to matplotlib Figures.

Figures are built with ``matplotlib.figure.Figure`` (no pyplot, so no global state and no GUI
backend); ``vlmshard.report.html_report`` renders them with Agg. Each figure has a title, labelled
axes and a caption (``report_figures``) that says how to read it. Every figure compares something:
plans (the report adds its own baseline packings to a lone plan), steps, ranks, or a training
run's measurements with their prediction; a figure that would show one plan's bars alone is left
out.
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from vlmshard.simulate.replay import Replay

from .series import PlanSeries

WIDTH = 10.0  # inches; at 100 dpi a figure is 1000 px wide
ROW_HEIGHT = 2.6
MAX_SOURCES = 9  # the source-mix plot folds smaller sources into "other"
MAX_STAGE_LEGEND = 8  # more pipeline stages than this share one legend entry
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
        for series, name in ((p.vit_imbalance, "ViT (Σtiles)"),
                             (p.llm_imbalance, "LLM (Σtokens)"),
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
        ranks = p.rank_cost.shape[1]
        for r, line in enumerate(np.cumsum(p.rank_cost, axis=0).T):
            label = (f"rank {r}" if ranks <= MAX_RANK_LEGEND
                     else f"each of {ranks} ranks" if r == 0 else None)
            ax.plot(steps, line / scale, lw=0.8, alpha=0.8, label=label)
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
    labels = [p.label.replace(" (", "\n(") for p in plans]  # "isf\n(baseline)": short ticks
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


def train_figure(replay: Replay) -> Figure:
    """A training run's measured pipeline bubble per stage and DP waiting against the replay's:
    over the run, step by step, and the one against the other."""
    m, p = replay.measured, replay.predicted
    stages, dp = m.busy.shape[2], m.busy.shape[1]
    fig = Figure(figsize=(WIDTH, 4.2), layout="constrained")
    fig.suptitle(f"Training run, measured vs replayed: pipeline bubble and DP waiting "
                 f"({len(replay.steps)} steps, PP {stages}, DP {dp})")
    bars, scatter, lines = fig.subplots(1, 3, width_ratios=[1.2, 1, 1.2])

    names = [f"stage {s}" for s in range(stages)] + ["DP wait"]
    x = np.arange(len(names))
    for offset, (label, times), color in zip((-0.2, 0.2), (("measured", m), ("predicted", p)),
                                             ("0.25", "0.7")):
        values = [*times.stage_bubble(), times.waiting()]
        drawn = bars.bar(x + offset, values, 0.4, label=label, color=color)
        if len(names) <= MAX_STAGE_LEGEND:
            bars.bar_label(drawn, fmt="%.2f", fontsize="x-small")
    bars.set_xticks(x, names, rotation=0 if len(names) <= 5 else 60, fontsize="small")
    bars.set_ylabel("share of the pipeline's time")
    bars.set_title("over the run: bubble per stage, DP waiting", fontsize="medium")
    bars.set_ylim(0, 1)
    bars.legend(fontsize="x-small", loc="upper right")

    m_stage, p_stage = m.stage_bubble_per_step(), p.stage_bubble_per_step()
    for s in range(stages):
        label = (f"stage {s} bubble" if stages <= MAX_STAGE_LEGEND
                 else "each stage's bubble" if s == 0 else None)
        scatter.scatter(p_stage[:, s], m_stage[:, s], s=14, alpha=0.75, label=label)
    scatter.scatter(p.waiting_per_step(), m.waiting_per_step(), s=22, marker="x", color="k",
                    label="DP waiting")
    scatter.plot([0, 1], [0, 1], "k:", lw=1, label="measured = predicted")
    scatter.set_xlim(0, 1)
    scatter.set_ylim(0, 1)
    scatter.set_xlabel("predicted (replay)")
    scatter.set_ylabel("measured")
    scatter.set_title("one point per stage per step", fontsize="medium")
    scatter.legend(fontsize="x-small", loc="best")

    for series, color, name in ((lambda t: t.stage_bubble_per_step().mean(axis=1), "C0",
                                 "bubble (all stages)"),
                                (lambda t: t.waiting_per_step(), "C3", "DP waiting")):
        lines.plot(replay.steps, series(m), "-o", color=color, ms=3, lw=1.2,
                   label=f"{name}, measured")
        lines.plot(replay.steps, series(p), "--", color=color, lw=1.2,
                   label=f"{name}, predicted")
    lines.set_xlabel("training step")
    lines.xaxis.set_major_locator(MaxNLocator(integer=True))
    lines.set_ylabel("share of the pipeline's time")
    lines.set_title("per step", fontsize="medium")
    lines.set_ylim(0, 1)
    lines.legend(fontsize="x-small", loc="best")
    return fig


def report_figures(plans: list[PlanSeries], train: Replay | None = None
                   ) -> list[tuple[Figure, str]]:
    """Every figure of the report with its caption, in page order. With a single plan (its
    baselines could not be packed) the figures that only compare plans are left out."""
    figures = []
    if len(plans) > 1:
        figures.append((comparison_figure(plans),
                        "Each panel is one balance metric with one bar per plan (the report's "
                        "own baseline packings of the same samples included); the panel title "
                        "says which way is better."))
    figures.append((imbalance_figure(plans),
                    "For each step, the share of the step that ranks would wait on the busiest "
                    "rank's tiles, tokens or attention work; the means are the plan's dist ratios. "
                    "Flat near 0 is balanced; spikes are unbalanced steps."))
    if len(plans) > 1:
        figures.append((fill_figure(plans),
                        "Histograms over micro-batches of Σtiles / Qv and Σseq_len / Qt, one "
                        "line per plan: mass near 1 means full micro-batches; mass to the left is "
                        "padding paid for by every micro-batch."))
    figures += [
        (cumulative_load_figure(plans),
         "Each rank's cost summed over the steps; the dashed line sums the slowest rank of each "
         "step, which is the time a step-synchronous run takes. The gap between a rank's line "
         "and the dashed line is that rank's accumulated waiting."),
        (source_mix_figure(plans),
         "The share of each source among a step's samples (largest sources, the rest as "
         "'other'): level bands mean every step mirrors the dataset's mix; bands that drift mean "
         "the plan reorders the data by source. source_mix_tv (in each title) is the mean over "
         "steps of the total-variation distance between a step's source shares and the whole "
         "plan's: 0 when every step mixes sources as the dataset does, 1 when steps hold "
         "disjoint sources. A step of a few samples cannot mirror many sources, so compare it "
         "between plans of the same data; balancing moves samples between steps to even their "
         "cost, and may raise it a little, which is the price of balance, not a sorted order "
         "(order_spearman says that)."),
    ]
    if train is not None:
        figures.append((train_figure(train),
                        "Left: over the training run (warm-up step left out), each stage's "
                        "pipeline bubble (1 − its forward + backward over its replica's pipeline "
                        "time) and the DP waiting (replicas idle until the slowest replica's "
                        "pipeline ends), measured and as the simulator's 1F1B replay of the "
                        "same micro-batches predicts. Middle: the same per step, points on the "
                        "dotted line mean the prediction held. Right: over the steps. The "
                        "all-reduce and optimizer after the pipeline are in neither."))
    return figures
