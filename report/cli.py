"""``vlmshard report``: the command-line face of ``vlmshard.report.report.run_report``."""

from __future__ import annotations

from vlmshard.stage import stage_command

from .config import ReportConfig

DESCRIPTION = """\
Prints one table with a column per PLAN_DIR (headed by its algorithm, or its folder name when two
plans share an algorithm) and a row per metric: pad ratio, ViT / LLM / attention dist ratios
(OmniBal's Dist Ratio; 0 is perfect), fills of Qv and Qt, cost efficiency (1: no rank ever
waits), Spearman rho between step index and step mean length, source-mix distance, and counts.

--out-json PATH writes the same as JSON (--json prints it instead of the table). --html PATH
writes one self-contained page (images inlined) with plots: per-step imbalance, micro-batch
fill, per-rank cumulative load, source mix over steps and the plans side by side. The plots read
the stats the plan was packed from (the path plan.run.json names; the sha256 plan.json records
must still match).

A lone plan is compared with random and ISF packings of exactly the samples it packs, which the
report packs itself under each algorithm's own caps, raised where they would leave one of them
out (the summary's predicted speed-ups, over equal samples; the plots show them as
"(baseline)"; report.json lists them under "baselines").

--train-log RUN/train_log.jsonl (written by vlmshard train on the FIRST plan's shards) sets the
run's measured pipeline bubble (per stage: 1 - forward + backward over its replica's pipeline
time) and DP waiting (replicas idle until the slowest replica's pipeline ends) against the
simulator's replay of the same run: each logged step's micro-batches through 1F1B with the
run's stage partition (RUN/pipeline.json) and the analytic FLOPs of its model, or with
--profile DIR the measured layer times of `vlmshard train profile` (then step times too). Per
step: correlation and median absolute error. The first step (warm-up) is left out."""


add_arguments, main = stage_command("report", ReportConfig, "vlmshard.report.report:run_report")
