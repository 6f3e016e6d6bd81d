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
from dataclasses import asdict, dataclass
from typing import Any, Callable

from vlmshard.config import add_options, load_config, load_section, option

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
                              "OUT/model (random weights; internvl, qwen2_vl, qwen2_5_vl, ...): "
                              "preprocess tokenizes for it and train fine-tunes it")
    preprocess: Section = option(factory=dict, cli=False,
                                 help="needs `inputs` unless demo_data is given")
    pack: Section = option(factory=dict, cli=False, help="needs `dp`")
    write: Section = option(factory=dict, cli=False, help="vlmshard write's options")
    verify: Section = option(factory=dict, cli=False, help="vlmshard verify's options")
    train: Section | None = option(None, cli=False, help="omit to stop after verify")

    def path(self, name: str) -> str:
        return os.path.join(self.out, name)


@dataclass
class StageResult:
    name: str
    seconds: float
    summary: str


def stages(cfg: RunConfig, where: str = "run config") -> list[tuple[str, Callable[[], str]]]:
    """(name, action) of every stage the config asks for; each action returns a summary line.
    ``where`` names the config in errors."""
    from vlmshard.packing.config import PackConfig
    from vlmshard.preprocess.config import DemoDataConfig, PreprocessConfig
    from vlmshard.shards.config import VerifyConfig, WriteConfig
    from vlmshard.train.config import TrainConfig

    pre, plan, shards, run = (cfg.path(n) for n in ("preprocess", "plan", "shards", "train"))
    inputs = {"inputs": [os.path.join(cfg.path("data"), "meta.json")]} if cfg.demo_data else {}
    if cfg.demo_model is not None:
        from vlmshard.families import model_types

        if cfg.demo_model not in model_types():
            raise ValueError(f"{where}: demo_model {cfg.demo_model!r}: known model types are "
                             f"{', '.join(model_types())}")
        inputs["model"] = cfg.path("model")

    def section(cls, values: dict, name: str, **connected):
        return load_section(cls, values, f"{where}, section '{name}'", **connected)

    # Every section is checked before any stage runs: a typo must not cost a preprocess.
    demo_cfg = section(DemoDataConfig, cfg.demo_data, "demo_data", out=cfg.path("data")) \
        if cfg.demo_data is not None else None
    pre_cfg = section(PreprocessConfig, cfg.preprocess, "preprocess", out=pre, **inputs)
    pack_cfg = section(PackConfig, cfg.pack, "pack", stats=pre, out=plan)
    write_cfg = section(WriteConfig, cfg.write, "write", plan=plan, stats=pre, out=shards)
    verify_cfg = section(VerifyConfig, cfg.verify, "verify", shards=shards, plan=plan)
    train_cfg = section(TrainConfig, cfg.train, "train", shards=shards, out=run) \
        if cfg.train is not None else None
    for checked in (pre_cfg, pack_cfg, write_cfg, train_cfg):
        if checked is not None:
            checked.validate()

    def demo_data() -> str:
        from vlmshard.preprocess.demo_data import generate

        return f"demo dataset -> {generate(demo_cfg.out, demo_cfg.seed, demo_cfg.scale).meta}"

    def demo_model() -> str:
        from vlmshard.preprocess.demo_data import demo_model as make

        return f"tiny {cfg.demo_model} -> {make(cfg.demo_model, cfg.path('model'))}"

    def preprocess() -> str:
        from vlmshard.preprocess.job import run_preprocess

        result = run_preprocess(pre_cfg)
        return f"{result.accepted} accepted, {result.rejected} rejected -> {pre}"

    def pack() -> str:
        from vlmshard.packing.plan import run_pack

        m = run_pack(pack_cfg).metrics
        return (f"{m.samples} samples in {m.steps} steps, cost efficiency "
                f"{m.cost_efficiency:.3f}, LLM dist ratio {m.llm_dist_ratio:.4f} -> {plan}")

    def write() -> str:
        from vlmshard.shards.writer import run_write

        result = run_write(write_cfg)
        return f"{result.shards} shards, {result.bytes / 1e6:.1f} MB -> {shards}"

    def verify() -> str:
        from vlmshard.shards.verify import verify_shards

        result = verify_shards(verify_cfg.shards, plan=verify_cfg.plan, quick=verify_cfg.quick,
                               workers=verify_cfg.workers)
        if not result.ok:
            raise RuntimeError(f"verify found {len(result.problems)} problem(s), the first: "
                               f"{result.problems[0]}")
        return f"OK: {result.records} records, {result.samples} samples, every one as planned"

    def train_stage() -> str:
        from vlmshard.train.launcher import train

        os.makedirs(run, exist_ok=True)
        output = os.path.join(run, "launcher.log")
        records = train(train_cfg, output=output)
        return (f"{len(records)} steps, loss {records[0]['loss']:.3f} -> "
                f"{records[-1]['loss']:.3f} -> {run} (DeepSpeed's output: {output})")

    def report() -> str:
        from vlmshard.report.report import make_report
        from vlmshard.run_log import LOG_NAME

        log_file = os.path.join(run, LOG_NAME) if cfg.train is not None else None
        result, _ = make_report([plan], train_log=log_file, html=cfg.path("report.html"),
                                json=cfg.path("report.json"))
        return (f"{result['summary']['text']} -> {cfg.path('report.html')}, "
                f"{cfg.path('report.json')}")

    chosen = [("demo-data", demo_data)] if cfg.demo_data is not None else []
    chosen += [("demo-model", demo_model)] if cfg.demo_model is not None else []
    chosen += [("preprocess", preprocess), ("pack", pack), ("write", write), ("verify", verify)]
    chosen += [("train", train_stage)] if cfg.train is not None else []
    return chosen + [("report", report)]


def run_all(cfg: RunConfig, on_stage: Callable[[int, int, StageResult], None] | None = None,
            where: str = "run config") -> list[StageResult]:
    """Run the stages in order; ``on_stage(index, count, result)`` after each one."""
    todo = stages(cfg, where)
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
    add_options(p, RunConfig)


def main(args: argparse.Namespace) -> int:
    def show(index: int, count: int, result: StageResult) -> None:
        print(f"[{index + 1}/{count}] {result.name:<10} {result.seconds:6.1f}s  {result.summary}",
              flush=True)

    if not getattr(args, "config", None):
        raise SystemExit("vlmshard run: error: --config is required (e.g. configs/demo.yaml)")
    try:
        where = f"config {args.config}"
        cfg = load_config(RunConfig, args)
        results = run_all(cfg, show, where)
    except (ValueError, OSError, RuntimeError) as e:
        raise SystemExit(f"vlmshard run: error: {e}") from None
    total = sum(r.seconds for r in results)
    trained = " and the training run, measured against predicted" if cfg.train is not None \
        else ""
    print(f"done in {total:.0f}s: open {cfg.path('report.html')} for the balance report{trained}")
    log.debug("run config: %s", asdict(cfg))
    return 0
