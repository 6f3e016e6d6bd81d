"""Start the training processes: ``train.trainer`` on PP × DP local processes through DeepSpeed's
launcher (its CPU accelerator takes the process count from ``LOCAL_SIZE``; gloo on CPU)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import asdict

from vlmshard.io import write_json_atomic

from .config import TrainConfig
from .train_log import LOG_NAME, read_log


def launch(cfg: TrainConfig, output: str | None = None) -> int:
    """Run the training processes to completion; returns the launcher's exit status.

    The processes print to this process's stdout and stderr, or append to the file ``output``
    (``vlmshard run`` keeps DeepSpeed's chatter out of its one line per stage)."""
    import torch

    cfg.validate()
    cfg.model = cfg.model_path()  # a missing folder fails here, not in every process
    os.makedirs(cfg.out, exist_ok=True)
    config_path = os.path.join(os.path.abspath(cfg.out), "train_config.json")
    write_json_atomic(config_path, asdict(cfg.training_options()))
    processes = cfg.pp * cfg.dp
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["LOCAL_SIZE"] = str(processes)  # DeepSpeed's CPU accelerator counts "devices" here
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(processes),
           "--master_port", str(port), "--module", "vlmshard.train.trainer", config_path]
    if output is None:
        return subprocess.call(cmd, env=env)
    with open(output, "ab") as sink:
        return subprocess.call(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT)


def train(cfg: TrainConfig, output: str | None = None) -> list[dict]:
    """Train to completion and return ``train_log.jsonl``'s records; raises if a process fails.

    ``output``: as in :func:`launch`; a failure then quotes the file's last lines."""
    status = launch(cfg, output)
    if status:
        raise RuntimeError(f"the training processes exited with status {status} "
                           f"(run folder {cfg.out}){_tail(output)}")
    return read_log(os.path.join(cfg.out, LOG_NAME))


def _tail(path: str | None, lines: int = 20) -> str:
    """The last lines of the processes' output file, to quote in an error."""
    if path is None or not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8", errors="replace") as f:
        last = f.read().splitlines()[-lines:]
    return f"; the last lines of {path}:\n" + "\n".join(last)
