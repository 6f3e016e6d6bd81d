"""Options are defined once and typed: every shipped config loads as the command it documents,
YAML values arrive with their declared types, and a wrong value is one line naming the key, the
type it needs and the file."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

from helpers import REPO, vlmshard
from vlmshard.config import ConfigError, load_config
from vlmshard.run import RunConfig, stages
from vlmshard.simulate.config import SimulateConfig
from vlmshard.train.config import ProfileConfig, TrainConfig

CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))
# config name prefix -> (options class, required paths, the command's own checks); a config
# checks its own values as it is made (__post_init__)
COMMANDS = {"train": (TrainConfig, {"shards": "SHARDS", "out": "RUN"}, None),
            "simulate": (SimulateConfig, {"plan": "PLAN"}, None),
            "demo": (RunConfig, {}, stages),  # run checks every section before any stage
            "run": (RunConfig, {}, stages)}


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_loads_as_its_command(path):
    kind = os.path.basename(path).split("-")[0].removesuffix(".yaml")
    cls, required, check = COMMANDS[kind]
    cfg = load_config(cls, {**required, "config": path})
    if check:
        check(cfg)


def test_yaml_values_arrive_typed(tmp_path):
    # YAML 1.1 reads 3e-4 (no dot) as a string; the declared float type converts it.
    path = tmp_path / "t.yaml"
    path.write_text("lr: 3e-4\nweight-decay: 1e-2\nmax_steps: 7\nsave_checkpoints: no\n"
                    "bounds: [0, 3, 6]\nmodel: /models/x\n")
    cfg = load_config(TrainConfig, {"shards": "S", "out": "R", "config": str(path)})
    assert (cfg.lr, cfg.weight_decay, cfg.max_steps) == (0.0003, 0.01, 7)
    assert type(cfg.lr) is float and cfg.save_checkpoints is False and cfg.bounds == [0, 3, 6]
    assert cfg.model == "/models/x"
    sim = tmp_path / "s.yaml"
    sim.write_text("mfu: 4e-1\n")
    assert load_config(SimulateConfig, {"plan": "P", "config": str(sim)}).mfu == 0.4


def test_flags_override_the_file_and_are_typed_alike(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("pp: 2\nlr: 1e-4\nmemory_budget: 40GiB\n")
    cfg = load_config(ProfileConfig, {"shards": "S", "out": "R", "config": str(path),
                                      "lr": "5e-4", "validate_top": "2"})
    assert (cfg.pp, cfg.lr, cfg.validate_top, cfg.memory_budget) == (2, 0.0005, 2, "40GiB")


@pytest.mark.parametrize("text,expected", [
    ("lr: fast\n", "lr: expected float, got 'fast'"),
    ("pp: 2.5\n", "pp: expected int, got 2.5"),
    ("max_steps: [1]\n", "max_steps: expected int or null, got [1]"),
    ("lrr: 0.1\n", "unknown key(s) lrr"),
    ("model: [a, b]\n", "model: expected str or null"),
])
def test_a_wrong_yaml_value_is_one_line_naming_key_type_and_file(tmp_path, text, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, {"shards": "S", "out": "R", "config": str(path)})
    assert expected in str(e.value) and "\n" not in str(e.value)
    assert str(path) in str(e.value)
    proc = vlmshard("train", "--config", str(path), "--shards", "S", "--out", str(tmp_path / "r"),
                    check=False)
    assert proc.returncode != 0 and expected in proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr  # one line, no traceback


def test_a_yaml_syntax_error_names_line_and_column(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("lr: 0.1\npp: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML at line 3, column 1: while parsing a "
                                          "flow sequence: expected ',' or ']'"):
        load_config(TrainConfig, {"shards": "S", "out": "R", "config": str(path)})


def test_run_sections_use_the_stage_definitions(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(f"out: {tmp_path / 'o'}\npreprocess: {{inputs: [x.json]}}\n"
                    "pack: {dp: two}\n")
    proc = vlmshard("run", "--config", str(path), check=False)
    assert proc.returncode != 0
    assert f"config {path}, section 'pack': dp: expected int, got 'two'" in proc.stderr


def test_a_run_config_gives_the_report_its_options(tmp_path):
    """``report:`` holds ``vlmshard report``'s options, checked by its definitions: a profile
    to replay the run with, which needs the train section's log."""
    out = str(tmp_path / "o")
    base = {"out": out, "preprocess": {"inputs": ["x.json"]}, "pack": {"dp": 2}}
    chosen = stages(RunConfig(**base, train={"pp": 2}, report={"profile": "prof"}))
    report = next(options for stage, options, _ in chosen if stage.name == "report")
    assert (report.profile, report.train_log) == ("prof", os.path.join(out, "train",
                                                                       "train_log.jsonl"))
    with pytest.raises(ConfigError, match="section 'report'.*give its --train-log too"):
        stages(RunConfig(**base, report={"profile": "prof"}))


def test_help_texts_state_each_default_once():
    out = subprocess.run([sys.executable, "-m", "vlmshard.cli", "pack", "--help"],
                         capture_output=True, text=True, check=True, cwd=REPO).stdout
    flat = " ".join(out.split())
    assert flat.count("(default: 1)") == 2  # --micro-batches, --epochs
    assert "--target-samples N samples per micro-batch: for random and lengthgroup exactly; " \
           "for isf the mean its caps search aims at; for balanced the default memory bound " \
           "(default: 4)" in flat
    assert "(default: balanced)" in flat and "(default: the model folder the stats were" in flat
