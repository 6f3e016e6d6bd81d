"""``vlmshard run``: every stage in order from one config, each output feeding the next.

demo data (optional) → preprocess → pack → write → verify → train → report. All outputs go
under ``out`` (``data/``, ``preprocess/``, ``plan/``, ``shards/``, ``train/``, ``report.html``,
``report.json``); each section of the config holds the options of its own subcommand, less the
paths ``run`` connects. Every stage resumes or redoes deterministically, so a rerun after a
crash picks up where the failed stage was.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from vlmshard.config import check_keys, from_mapping, load_config

log = logging.getLogger(__name__)

HELP = "run every stage from one config: preprocess, pack, write, verify, train, report"
DESCRIPTION = """\
Runs the whole pipeline from one YAML config (e.g. configs/demo.yaml, what `make demo` runs):
  demo-data   (when the config has a demo_data section) the bundled demo dataset
  preprocess  tokenize and count tiles            -> OUT/preprocess
  pack        balanced micro-batches              -> OUT/plan
  write       pre-balanced WebDataset shards      -> OUT/shards
  verify      every shard against the plan
  train       DeepSpeed pipeline on the shards    -> OUT/train/train_log.jsonl (skipped when the
              config has no train section; the processes' output goes to
              OUT/train/launcher.log)
  report      balance metrics, plots, measured waiting -> OUT/report.html, OUT/report.json
Each section holds the options of its subcommand (see `vlmshard SUBCOMMAND --help`) except the
paths that connect the stages. A line per stage says what it did and how long it took."""


@dataclass
class RunConfig:
    """Options of ``vlmshard run``: the output folder and one section per stage."""

    out: str
    demo_data: dict | None = None  # {seed, scale}: make the demo dataset and preprocess it
    preprocess: dict = field(default_factory=dict)  # needs `inputs` unless demo_data is given
    pack: dict = field(default_factory=dict)  # needs `dp`
    write: dict = field(default_factory=dict)
    verify: dict = field(default_factory=dict)
    train: dict | None = None  # omit to stop after verify

    def path(self, name: str) -> str:
        return os.path.join(self.out, name)


@dataclass
class StageResult:
    name: str
    seconds: float
    summary: str


def stages(cfg: RunConfig) -> list[tuple[str, Callable[[], str]]]:
    """(name, action) of every stage the config asks for; each action returns a summary line."""
    from vlmshard.packing.plan import PackConfig, run_pack
    from vlmshard.report.report import make_report
    from vlmshard.preprocess import PreprocessConfig, run_preprocess
    from vlmshard.shards.verify import verify_shards
    from vlmshard.shards.writer import WriteConfig, run_write
    from vlmshard.train.launcher import train
    from vlmshard.train.trainer import TrainConfig

    pre, plan, shards, run = (cfg.path(n) for n in ("preprocess", "plan", "shards", "train"))
    inputs = {"inputs": [os.path.join(cfg.path("data"), "meta.json")]} if cfg.demo_data else {}

    def section(cls, values: dict, name: str, **connected):
        check_keys(cls, values, f"run config section '{name}'")
        return from_mapping(cls, {**values, **connected}, f"add them to the '{name}' section")

    # Every section is checked before any stage runs: a typo must not cost a preprocess.
    pre_cfg = section(PreprocessConfig, {**inputs, **cfg.preprocess}, "preprocess", out=pre)
    pack_cfg = section(PackConfig, cfg.pack, "pack", stats=pre, out=plan)
    write_cfg = section(WriteConfig, cfg.write, "write", plan=plan, stats=pre, out=shards)
    train_cfg = section(TrainConfig, cfg.train, "train", shards=shards, out=run) \
        if cfg.train is not None else None
    for checked in (pack_cfg, train_cfg):
        if checked is not None:
            checked.validate()

    def demo_data() -> str:
        from vlmshard.preprocess.demo_data import generate

        return f"demo dataset -> {generate(cfg.path('data'), **cfg.demo_data).meta}"

    def preprocess() -> str:
        result = run_preprocess(pre_cfg)
        return f"{result.accepted} accepted, {result.rejected} rejected -> {pre}"

    def pack() -> str:
        m = run_pack(pack_cfg).metrics
        return (f"{m.samples} samples in {m.steps} steps, cost efficiency "
                f"{m.cost_efficiency:.3f}, LLM dist ratio {m.llm_dist_ratio:.4f} -> {plan}")

    def write() -> str:
        result = run_write(write_cfg)
        return f"{result.shards} shards, {result.bytes / 1e6:.1f} MB -> {shards}"

    def verify() -> str:
        result = verify_shards(shards, plan=plan, **cfg.verify)
        if not result.ok:
            raise RuntimeError(f"verify found {len(result.problems)} problem(s), the first: "
                               f"{result.problems[0]}")
        return f"OK: {result.records} records, {result.samples} samples, every one as planned"

    def train_stage() -> str:
        os.makedirs(run, exist_ok=True)
        output = os.path.join(run, "launcher.log")
        records = train(train_cfg, output=output)
        return (f"{len(records)} steps, loss {records[0]['loss']:.3f} -> "
                f"{records[-1]['loss']:.3f} -> {run} (DeepSpeed's output: {output})")

    def report() -> str:
        log_file = os.path.join(run, "train_log.jsonl") if cfg.train is not None else None
        make_report([plan], train_log=log_file, html=cfg.path("report.html"),
                    json=cfg.path("report.json"))
        return f"-> {cfg.path('report.html')}, {cfg.path('report.json')}"

    chosen = [("demo-data", demo_data)] if cfg.demo_data is not None else []
    chosen += [("preprocess", preprocess), ("pack", pack), ("write", write), ("verify", verify)]
    chosen += [("train", train_stage)] if cfg.train is not None else []
    return chosen + [("report", report)]


def run_all(cfg: RunConfig, on_stage: Callable[[int, int, StageResult], None] | None = None
            ) -> list[StageResult]:
    """Run the stages in order; ``on_stage(index, count, result)`` after each one."""
    todo = stages(cfg)
    results = []
    for index, (name, action) in enumerate(todo):
        log.info("stage %d/%d: %s", index + 1, len(todo), name)
        start = time.monotonic()
        try:
            summary = action()
        except Exception as e:
            raise RuntimeError(f"stage {name} failed: {e}") from e
        results.append(StageResult(name, time.monotonic() - start, summary))
        if on_stage:
            on_stage(index, len(todo), results[-1])
    return results


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="run config, e.g. configs/demo.yaml")
    p.add_argument("--out", default=argparse.SUPPRESS, help="output folder (overrides the "
                                                             "config's 'out')")


def main(args: argparse.Namespace) -> int:
    def show(index: int, count: int, result: StageResult) -> None:
        print(f"[{index + 1}/{count}] {result.name:<10} {result.seconds:6.1f}s  {result.summary}",
              flush=True)

    try:
        cfg = load_config(RunConfig, {k: v for k, v in vars(args).items() if k != "config"},
                          args.config)
        results = run_all(cfg, show)
    except (ValueError, OSError, RuntimeError) as e:
        raise SystemExit(f"vlmshard run: error: {e}") from None
    total = sum(r.seconds for r in results)
    print(f"done in {total:.0f}s: open {cfg.path('report.html')} for the balance report"
          f"{' and the measured waiting' if cfg.train is not None else ''}")
    log.debug("run config: %s", asdict(cfg))
    return 0
