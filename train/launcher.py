"""Start the training processes: ``train.trainer`` on PP × DP local processes through DeepSpeed's
launcher (its CPU accelerator takes the process count from ``LOCAL_SIZE``; gloo on CPU)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import asdict

from vlmshard.io import write_json_atomic

from .trainer import TrainConfig


def launch(cfg: TrainConfig) -> int:
    """Run the training processes to completion; returns the launcher's exit status."""
    import torch

    cfg.validate()
    os.makedirs(cfg.out, exist_ok=True)
    config_path = os.path.join(os.path.abspath(cfg.out), "train_config.json")
    write_json_atomic(config_path, asdict(cfg))
    processes = cfg.pp * cfg.dp
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["LOCAL_SIZE"] = str(processes)  # DeepSpeed's CPU accelerator counts "devices" here
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(processes),
           "--master_port", str(port), "--module", "train.trainer", config_path]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    return subprocess.call(cmd, env=env)


def train(cfg: TrainConfig) -> list[dict]:
    """Train to completion and return ``train_log.jsonl``'s records; raises if a process fails."""
    status = launch(cfg)
    if status:
        raise RuntimeError(f"the training processes exited with status {status} "
                           f"(run folder {cfg.out})")
    return read_log(os.path.join(cfg.out, "train_log.jsonl"))


def read_log(path: str) -> list[dict]:
    """The records of a ``train_log.jsonl``, one per step."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
