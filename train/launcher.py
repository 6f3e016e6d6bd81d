"""Start the training processes: ``vlmshard.train.trainer`` on PP × DP processes through
DeepSpeed's launchers, on one node or many (``vlmshard.train.cluster``); gloo on CPU, where
DeepSpeed's CPU accelerator takes the processes per node from ``LOCAL_SIZE``."""

from __future__ import annotations

import base64
import json
import logging
import os
import subprocess
import sys
from dataclasses import asdict, dataclass

from vlmshard.compat import check_torch, check_transformers
from vlmshard.errors import ConfigError, InputError, JobError
from vlmshard.io import read_json, write_json_atomic
from vlmshard.process import log_level
from vlmshard.run_log import LOG_NAME, PIPELINE_NAME, read_log, stage_bounds
from vlmshard.stage import Result

from .cluster import Cluster
from .config import TrainConfig
from .default_partition import Device, choose_partition

log = logging.getLogger(__name__)


@dataclass
class TrainResult(Result):
    out: str
    steps: int  # the steps train_log.jsonl holds (a resumed run's earlier ones included)
    first_loss: float | None
    last_loss: float | None
    output: str | None = None  # the file the processes wrote to (None: this terminal)
    bounds: list[int] | None = None  # the stage partition that ran (pipeline.json)
    partition_source: str = ""  # where it came from
    adapter: str | None = None  # under LoRA, the PEFT adapter folder written

    def summary(self) -> str:
        loss = f", loss {self.first_loss:.3f} -> {self.last_loss:.3f}" if self.steps else ""
        where = f" (DeepSpeed's output: {self.output})" if self.output else ""
        cut = (f", stages {self.bounds} ({self.partition_source.split(':')[0]})"
               if self.bounds else "")
        adapter = f" (LoRA adapter: {self.adapter})" if self.adapter else ""
        return f"{self.steps} steps{loss}{cut} -> {self.out}{adapter}{where}"


def run_train(cfg: TrainConfig, output: str | None = None) -> TrainResult:
    """``vlmshard train``: train to completion; ``output`` as in :func:`launch`."""
    if output:
        os.makedirs(os.path.dirname(output) or ".", exist_ok=True)
    records = train_and_read_log(cfg, output)
    pipeline = read_json(os.path.join(cfg.out, PIPELINE_NAME))
    adapter = os.path.join(cfg.out, "adapter")
    return TrainResult(cfg.out, len(records), records[0]["loss"] if records else None,
                       records[-1]["loss"] if records else None, output,
                       stage_bounds(pipeline["stages"]),
                       pipeline.get("partition_source", ""),
                       adapter if cfg.lora_rank and os.path.isdir(adapter) else None)


def model_folder(cfg: TrainConfig) -> str:
    """``cfg.model``, or the folder the shards were preprocessed with; checked here (its family,
    a tensor for every parameter, as the stages will load them, and something to train), so a
    wrong folder or recipe is one line, not a traceback in every process."""
    from vlmshard.families import read_model_folder

    from .hf_model import model_layers

    path = cfg.model
    if path is None:
        from vlmshard.shards.layout import read_manifest

        path = read_manifest(cfg.shards).model_spec().path
        if not path:
            raise ConfigError(f"{cfg.shards} were preprocessed without a model folder "
                              "(the default tokenizer); name the model to train with --model")
    folder = read_model_folder(path).path
    layers = model_layers(folder, recipe=cfg.recipe)
    layers.checkpoint.check_complete(layers.meta)
    layers.modes  # a recipe that leaves nothing to train is refused here, and
    layers.lora_blocks()  # LoRA targets that match no layer
    return folder


def check_sequence_parallel(cfg: TrainConfig) -> None:
    """Shards with sequence-parallel steps this run cannot train are one line here
    (``sequence_parallel.check_model``)."""
    from vlmshard.shards.layout import read_manifest

    from .hf_model import model_layers
    from .sequence_parallel import check_model

    check_model(model_layers(cfg.model), read_manifest(cfg.shards), pp=cfg.pp, dp=cfg.dp)


def resolve_partition(cfg: TrainConfig) -> None:
    """Take ``bounds`` and ``recompute`` from ``cfg.partition`` (the profile's chosen one)."""
    if not cfg.partition:
        return
    try:
        chosen = read_json(cfg.partition)["chosen"]
        bounds = chosen["bounds"]
    except (KeyError, TypeError) as e:
        raise InputError(f"{cfg.partition}: no chosen partition (write it with vlmshard train "
                         "profile)") from e
    if len(bounds) != cfg.pp + 1:
        raise ConfigError(f"{cfg.partition} splits the model into {len(bounds) - 1} stages, "
                          f"not --pp {cfg.pp}")
    cfg.use_partition(chosen)


def launch(cfg: TrainConfig, output: str | None = None) -> int:
    """Run this node's training processes (every node's, with ``--hostfile``) to completion;
    returns the launcher's exit status.

    The processes print to this process's stdout and stderr, or append to the file ``output``
    (``vlmshard run`` keeps DeepSpeed's chatter out of its one line per stage)."""
    check_torch()  # a release outside the supported ranges is one line, before anything is built
    check_transformers()
    resolve_partition(cfg)
    cfg.model = model_folder(cfg)  # a missing folder fails here, not in every process
    check_sequence_parallel(cfg)
    import torch

    cuda = torch.cuda.is_available()
    cfg.resolve_device_defaults(cuda)
    cluster = Cluster.resolve(cfg.pp * cfg.dp, os.environ, hostfile=cfg.hostfile,
                              master_port=cfg.master_port)
    cluster.check_port()
    visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cuda:
        cluster.check_devices(torch.cuda.device_count(), visible_devices)
    if cfg.bounds is None:  # caps no recompute fits are one line here, before any rank starts
        from vlmshard.shards.layout import read_manifest

        from .hf_model import rank_model

        model = rank_model(cfg, "cuda" if cuda else "cpu",
                           max(read_manifest(cfg.shards).sp_degrees) > 1)
        choose_partition(cfg, model, Device.probe() if cuda else None, cluster.procs_per_node)
    os.makedirs(cfg.out, exist_ok=True)
    config_path = os.path.join(os.path.abspath(cfg.out), "train_config.json")
    write_json_atomic(config_path, asdict(cfg.training_options()))
    env = dict(os.environ)
    if not cuda:
        env["LOCAL_SIZE"] = str(cluster.procs_per_node)  # the CPU accelerator's "devices"
        # named, DeepSpeed's CPU accelerator is taken without the warning that it found no GPU
        env.setdefault("DS_ACCELERATOR", "cpu")
    elif not {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"} & set(env):
        # packed micro-batches change shape every step: segments that grow in place keep the
        # allocator from fragmenting (the older name: torch 2.9's new one ignored this option)
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    cmd = launcher_command(cluster, visible_devices if cuda else None) + [
        "--module", "vlmshard.train.trainer", f"--log-level={log_level()}", config_path]
    if output is None:
        return subprocess.call(cmd, env=env)
    with open(output, "ab") as sink:
        return subprocess.call(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT)


def launcher_command(cluster: Cluster, visible_devices: str | None = None) -> list[str]:
    """DeepSpeed's multi-node runner for a hostfile, its per-node launcher otherwise (one node,
    or this node of a job started on every node), keeping the scheduler's
    ``visible_devices``; either logs at this process's level (the runner passes it on)."""
    level = f"--log_level={log_level().lower()}"
    if cluster.hostfile:
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", cluster.hostfile,
               "--master_port", str(cluster.master_port), level]
        return cmd + (["--master_addr", cluster.master_addr] if cluster.master_addr else [])
    info = json.dumps(cluster.world_info(visible_devices))
    world = base64.urlsafe_b64encode(info.encode()).decode()
    return [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world}",
            f"--node_rank={cluster.node_rank}", f"--master_addr={cluster.master_addr}",
            f"--master_port={cluster.master_port}", level]


def train_and_read_log(cfg: TrainConfig, output: str | None = None) -> list[dict]:
    """Train to completion and return ``train_log.jsonl``'s records; raises if a process fails.

    ``output``: as in :func:`launch`; a failure then logs the file's last lines."""
    status = launch(cfg, output)
    if status:
        where = f"; the last lines of {output} are logged above" if _log_tail(output) else ""
        raise JobError(f"the training processes exited with status {status} (run folder "
                       f"{cfg.out}){where}")
    return read_log(os.path.join(cfg.out, LOG_NAME))


def _log_tail(path: str | None, lines: int = 20) -> bool:
    """Log the last lines of the processes' output file (the error is one line); whether any."""
    if path is None or not os.path.exists(path):
        return False
    with open(path, encoding="utf-8", errors="replace") as f:
        last = f.read().splitlines()[-lines:]
    log.error("the last lines of %s:\n%s", path, "\n".join(last))
    return bool(last)
