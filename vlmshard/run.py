"""``vlmshard run``: every stage in order from one config, each output feeding the next.

demo data (optional) → preprocess → pack → write → verify → train → report. All outputs
go under ``out`` (``data/``, ``preprocess/``, ``plan/``, ``shards/``, ``train/``, ``report.html``,
``report.json``); each section of the config holds the options of its own subcommand, less the
paths ``run`` connects. Every stage resumes or redoes deterministically, so a rerun after a
crash picks up where the failed stage was.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from vlmshard.config import load_section, option
from vlmshard.errors import JobError, VlmshardError
from vlmshard.families import model_types
from vlmshard.stage import Result, add_stage_arguments, resolve, run_command
from vlmshard.run_log import LOG_NAME

log = logging.getLogger(__name__)

DESCRIPTION = """\
Runs the whole pipeline from one YAML config (e.g. configs/demo.yaml, what `make demo` runs):
  demo-data   (when the config has a demo_data section) the bundled demo dataset
  demo-model  (when the config names demo_model) a tiny model folder -> OUT/model
  preprocess  tokenize and count tiles            -> OUT/preprocess
  pack        balanced micro-batches              -> OUT/plan
  write       pre-balanced WebDataset shards      -> OUT/shards
  verify      every shard against the plan
  train       DeepSpeed pipeline on the shards    -> OUT/train/train_log.jsonl (skipped when the
              config has no train section; the processes' output goes to
              OUT/train/launcher.log)
  report      balance metrics and plots against random and ISF packings; the training run's
              measured pipeline bubble and DP waiting against the simulator's replay of it
              -> OUT/report.html, OUT/report.json
Each section holds the options of its subcommand (see `vlmshard SUBCOMMAND --help`) except the
paths that connect the stages. A line per stage says what it did and how long it took."""


Section = dict[str, Any]


@dataclass(kw_only=True)
class RunConfig:
    """Options of ``vlmshard run``: the output folder and one section per stage. A section holds
    the options of its subcommand, checked by the same definitions (``vlmshard pack --help``...)."""

    out: str = option(help="output folder of every stage")
    demo_data: Section | None = option(None, cli=False, help="{seed, scale}: make the demo "
                                                             "dataset and preprocess it")
    demo_model: str | None = option(
        None, cli=False, help="make a tiny model folder of this model_type (config.json's) under "
                              f"OUT/model (random weights; {', '.join(model_types())}): "
                              "preprocess tokenizes for it and train fine-tunes it")
    preprocess: Section = option(factory=dict, cli=False,
                                 help="needs `inputs` unless demo_data is given")
    pack: Section = option(factory=dict, cli=False, help="needs `dp`")
    write: Section = option(factory=dict, cli=False, help="vlmshard write's options")
    verify: Section = option(factory=dict, cli=False, help="vlmshard verify's options")
    train: Section | None = option(None, cli=False, help="omit to stop after verify")
    report: Section = option(factory=dict, cli=False,
                             help="vlmshard report's options (e.g. profile: a `train profile` "
                                  "folder to replay the training run with)")

    def path(self, name: str) -> str:
        return os.path.join(self.out, name)

    def section(self, name: str) -> Section | None:
        """The options section ``name`` gives its stage; None: the stage does not run."""
        value = getattr(self, name)
        return {"model_type": value} if name == "demo_model" and value is not None else value


# --- the table of stages -----------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """A path ``run`` connects: option ``name`` of a stage is ``OUT/path``."""

    name: str
    path: str
    when: str | None = None  # only when the run config has this section
    many: bool = False  # the option is a list: [OUT/path]
    argument: bool = False  # a keyword of the stage function, not one of its options


@dataclass(frozen=True)
class Stage:
    """One row of :data:`STAGES`; ``config`` and ``run`` are ``"module:name"``, imported when
    the stage runs (``vlmshard run --help`` stays light)."""

    name: str
    config: str  # the options class
    section: str  # the RunConfig field holding its options
    links: tuple[Link, ...]
    run: str  # run_<stage>(cfg, **arguments) -> Result


STAGES = (
    Stage("demo-data", "vlmshard.demo.config:DemoDataConfig", "demo_data",
          (Link("out", "data"),), "vlmshard.demo.data:run_demo_data"),
    Stage("demo-model", "vlmshard.demo.config:DemoModelConfig", "demo_model",
          (Link("out", "model"),), "vlmshard.demo.data:run_demo_model"),
    Stage("preprocess", "vlmshard.preprocess.config:PreprocessConfig", "preprocess",
          (Link("out", "preprocess"), Link("inputs", "data/meta.json", "demo_data", many=True),
           Link("model", "model", "demo_model")), "vlmshard.preprocess.job:run_preprocess"),
    Stage("pack", "vlmshard.packing.config:PackConfig", "pack",
          (Link("stats", "preprocess"), Link("out", "plan")), "vlmshard.packing.plan:run_pack"),
    Stage("write", "vlmshard.shards.config:WriteConfig", "write",
          (Link("plan", "plan"), Link("stats", "preprocess"), Link("out", "shards")),
          "vlmshard.shards.writer:run_write"),
    Stage("verify", "vlmshard.shards.config:VerifyConfig", "verify",
          (Link("shards", "shards"), Link("plan", "plan")), "vlmshard.shards.verify:run_verify"),
    Stage("train", "vlmshard.train.config:TrainConfig", "train",
          (Link("shards", "shards"), Link("out", "train"),
           Link("output", "train/launcher.log", argument=True)),
          "vlmshard.train.launcher:run_train"),
    Stage("report", "vlmshard.report.config:ReportConfig", "report",
          (Link("plan_dirs", "plan", many=True), Link("train_log", f"train/{LOG_NAME}", "train"),
           Link("html", "report.html"), Link("out_json", "report.json")),
          "vlmshard.report.report:run_report"),
)


def stages(cfg: RunConfig, where: str = "run config") -> list[tuple[Stage, Any, dict]]:
    """(stage, its checked options, its function's keywords) of every stage the config asks
    for, in order. Every section is checked here, before any stage runs: a typo must not cost a
    preprocess. ``where`` names the config in errors."""
    chosen = []
    for stage in STAGES:
        values = cfg.section(stage.section)
        if values is None:
            continue
        links = [link for link in stage.links if link.when is None
                 or cfg.section(link.when) is not None]
        paths = {link.name: [cfg.path(link.path)] if link.many else cfg.path(link.path)
                 for link in links}
        arguments = {link.name: paths.pop(link.name) for link in links if link.argument}
        options = load_section(resolve(stage.config), values,
                               f"{where}, section '{stage.section}'", **paths)
        chosen.append((stage, options, arguments))
    return chosen


@dataclass
class StageRun:
    name: str
    seconds: float
    summary: str


class StageFailed(JobError):
    """A stage of ``run`` failed; the stage's own exit status is kept."""

    def __init__(self, name: str, error: BaseException) -> None:
        super().__init__(f"stage {name} failed: {error}")
        self.exit_status = getattr(error, "exit_status", 1)


@dataclass
class RunResult(Result):
    stages: list[StageRun]
    report: str  # the HTML report
    trained: bool

    def summary(self) -> str:
        total = sum(s.seconds for s in self.stages)
        trained = " and the training run, measured against predicted" if self.trained else ""
        return f"done in {total:.0f}s: open {self.report} for the balance report{trained}"


def run_all(cfg: RunConfig, on_stage: Callable[[int, int, StageRun], None] | None = None,
            where: str = "run config") -> RunResult:
    """Run the stages in order; ``on_stage(index, count, stage_run)`` after each one."""
    todo = stages(cfg, where)
    done = []
    for index, (stage, options, arguments) in enumerate(todo):
        log.info("stage %d/%d: %s", index + 1, len(todo), stage.name)
        start = time.monotonic()
        try:
            # stdout carries this run's own lines (or its JSON): what libraries print while a
            # stage runs goes to stderr (DeepSpeed's logger, imported by transformers through
            # accelerate, writes to the stdout it finds when first imported).
            with contextlib.redirect_stdout(sys.stderr):
                result = resolve(stage.run)(options, **arguments)
        except (VlmshardError, OSError) as e:
            raise StageFailed(stage.name, e) from e
        if result.exit_status:
            raise StageFailed(stage.name, JobError(result.summary()))
        done.append(StageRun(stage.name, time.monotonic() - start, result.summary()))
        if on_stage:
            on_stage(index, len(todo), done[-1])
    return RunResult(done, cfg.path("report.html"), cfg.train is not None)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_stage_arguments(p, RunConfig)


def main(args: argparse.Namespace) -> int:
    def show(index: int, count: int, done: StageRun) -> None:
        print(f"[{index + 1}/{count}] {done.name:<10} {done.seconds:6.1f}s  {done.summary}",
              flush=True)

    if not getattr(args, "config", None):
        raise SystemExit("vlmshard run: error: --config is required (e.g. configs/demo.yaml)")
    where = f"config {args.config}"
    progress = None if args.json else show  # --json: stdout holds the JSON alone
    return run_command("run", RunConfig, lambda cfg: run_all(cfg, progress, where), args)
