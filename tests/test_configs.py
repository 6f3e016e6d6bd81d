"""Every shipped config in configs/ loads as the command it documents and passes its checks."""

from __future__ import annotations

import glob
import os

import pytest

from helpers import REPO
from vlmshard.model_sizes import layer_work
from vlmshard.model_sizes import ModelConfig
from vlmshard.simulate.cli import SimulateConfig
from vlmshard.train.trainer import TrainConfig
from vlmshard.config import load_config
from vlmshard.run import RunConfig, stages

CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))
# config name prefix -> (options class, required paths, the command's own checks)
COMMANDS = {"train": (TrainConfig, {"shards": "SHARDS", "out": "RUN"}, TrainConfig.validate),
            "simulate": (SimulateConfig, {"plan": "PLAN"}, SimulateConfig.validate),
            "demo": (RunConfig, {}, stages)}  # run checks every section before any stage


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_loads_as_its_command(path):
    kind = os.path.basename(path).split("-")[0].removesuffix(".yaml")
    cls, required, check = COMMANDS[kind]
    check(load_config(cls, required, path))


def test_gpu_config_is_about_a_billion_parameters():
    cfg = load_config(TrainConfig, {"shards": "S", "out": "R"},
                      os.path.join(REPO, "configs", "train-1b.yaml"))
    params = sum(w.params for w in layer_work(ModelConfig.from_dict(cfg.model)))
    assert 0.9e9 < params < 1.2e9
