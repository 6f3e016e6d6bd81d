"""Start the training processes: ``vlmshard.train.trainer`` on PP × DP processes through
DeepSpeed's launchers, on one node or many (``vlmshard.train.cluster``); gloo on CPU, where
DeepSpeed's CPU accelerator takes the processes per node from ``LOCAL_SIZE``."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from dataclasses import asdict

from vlmshard.io import write_json_atomic
from vlmshard.run_log import LOG_NAME, read_log

from .cluster import Cluster
from .config import TrainConfig


def launch(cfg: TrainConfig, output: str | None = None) -> int:
    """Run this node's training processes (every node's, with ``--hostfile``) to completion;
    returns the launcher's exit status.

    The processes print to this process's stdout and stderr, or append to the file ``output``
    (``vlmshard run`` keeps DeepSpeed's chatter out of its one line per stage)."""
    import torch

    cfg.validate()
    cuda = torch.cuda.is_available()
    cfg.resolve_device_defaults(cuda)
    cfg.model = cfg.model_path()  # a missing folder fails here, not in every process
    cluster = Cluster.resolve(cfg.pp * cfg.dp, os.environ, hostfile=cfg.hostfile,
                              master_port=cfg.master_port)
    cluster.check_port()
    os.makedirs(cfg.out, exist_ok=True)
    config_path = os.path.join(os.path.abspath(cfg.out), "train_config.json")
    write_json_atomic(config_path, asdict(cfg.training_options()))
    env = dict(os.environ)
    if not cuda:
        env["LOCAL_SIZE"] = str(cluster.procs_per_node)  # the CPU accelerator's "devices"
    cmd = launcher_command(cluster) + ["--module", "vlmshard.train.trainer", config_path]
    if output is None:
        return subprocess.call(cmd, env=env)
    with open(output, "ab") as sink:
        return subprocess.call(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT)


def launcher_command(cluster: Cluster) -> list[str]:
    """DeepSpeed's multi-node runner for a hostfile, its per-node launcher otherwise (one node,
    or this node of a job started on every node)."""
    if cluster.hostfile:
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", cluster.hostfile,
               "--master_port", str(cluster.master_port)]
        return cmd + (["--master_addr", cluster.master_addr] if cluster.master_addr else [])
    world = base64.urlsafe_b64encode(json.dumps(cluster.world_info()).encode()).decode()
    return [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world}",
            f"--node_rank={cluster.node_rank}", f"--master_addr={cluster.master_addr}",
            f"--master_port={cluster.master_port}"]


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
