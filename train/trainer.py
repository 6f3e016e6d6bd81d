"""The training loop each DeepSpeed process runs (started by ``vlmshard train`` through the
DeepSpeed launcher): stream this data-parallel rank's shards, one packed micro-batch per pipeline
micro-step, Ave-Token loss, a JSON line per step.

Every step takes ``micro_batches × V/W`` records from the rank's loader (the plan's step), so the
pipeline's gradient accumulation is the plan's micro-batches. The first stage decodes images;
the last stage reads the same records without pixels, for the labels and the token count.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    """Options of ``vlmshard train`` (CLI flags and YAML keys have these names)."""

    shards: str
    out: str
    model: dict = field(default_factory=lambda: {"preset": "tiny"})
    pp: int = 1
    dp: int = 1
    max_steps: int | None = None  # default: the shards' steps (more repeats the data)
    lr: float = 1e-3
    weight_decay: float = 0.0
    seed: int = 0
    partition: str | None = None  # partition.json of `vlmshard train profile` (its search)
    bounds: list[int] | None = None  # stage partition; default DeepSpeed's 'parameters'
    recompute: list[str] = field(default_factory=list)  # layer names recomputed in backward

    def validate(self) -> None:
        for name in ("pp", "dp"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"--max-steps must be at least 1, got {self.max_steps}")

    def resolve_partition(self) -> None:
        """Take ``bounds`` and ``recompute`` from ``partition`` (the searched choice)."""
        if not self.partition:
            return
        from vlmshard.io import read_json

        search = read_json(self.partition)["search"]
        if len(search["bounds"]) != self.pp + 1:
            raise ValueError(f"{self.partition} splits the model into "
                             f"{len(search['bounds']) - 1} stages, not --pp {self.pp}")
        self.bounds = search["bounds"]
        self.recompute = [name for stage in search["stages"] for name in stage["recompute"]]


def supervised_tokens(batch: dict) -> int:
    """Tokens with a next-token target in this micro-batch (the Ave-Token denominator's share)."""
    from .model import IGNORE_INDEX, next_token_targets

    return int((next_token_targets(batch["labels"], batch["position_ids"]) != IGNORE_INDEX).sum())


def repeated(shards: str, rank: int, world: int, pixels: bool) -> Iterator[dict]:
    """This rank's micro-batches, from step 0 again after the last step."""
    from shards.loader import ShardDataset

    while True:
        yield from ShardDataset(shards, rank, world, pixels=pixels)


def run(cfg: TrainConfig) -> None:
    import deepspeed
    import torch
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    from shards.loader import ShardDataset

    from .config import ModelConfig
    from .pipeline import AveTokenLoss, build_pipeline, pipeline_inputs

    cfg.validate()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    torch.manual_seed(cfg.seed)
    model_config = ModelConfig.from_dict(cfg.model)
    probe = ShardDataset(cfg.shards, 0, cfg.dp)
    if probe.manifest.tokenizer and model_config.tokens_per_tile != next(
            iter(probe.policies.values())).tokens_per_tile:
        raise ValueError(f"model makes {model_config.tokens_per_tile} tokens per tile, the shards "
                         f"were tokenized with {next(iter(probe.policies.values())).tokens_per_tile}")
    gas = probe.micro_batches_per_step
    steps = cfg.max_steps or probe.steps

    loss = AveTokenLoss()
    net = build_pipeline(model_config, cfg.pp, loss, bounds=cfg.bounds,
                         recompute=set(cfg.recompute),
                         topology=PipeDataParallelTopology(num_pp=cfg.pp, num_dp=cfg.dp))
    ds_config = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
        "train_batch_size": gas * cfg.dp, "steps_per_print": 10 ** 9,
        "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr,
                                                  "weight_decay": cfg.weight_decay}},
    }
    engine, _, _, _ = deepspeed.initialize(
        model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
        config=ds_config)
    loss.scale = gas * cfg.dp
    dp_rank = engine.grid.get_data_parallel_id()
    reads = engine.is_first_stage() or engine.is_last_stage()
    batches = repeated(cfg.shards, dp_rank, cfg.dp, pixels=engine.is_first_stage())
    logs = _open_logs(cfg, engine, dp_rank)
    for step in range(steps):
        micro = [next(batches) for _ in range(gas)] if reads else []
        tokens = torch.tensor([sum(supervised_tokens(b) for b in micro)], dtype=torch.long)
        if engine.is_last_stage():
            deepspeed.comm.all_reduce(tokens, group=engine.grid.get_data_parallel_group())
            loss.global_tokens = int(tokens)
        start = time.perf_counter()
        value = engine.train_batch(iter([pipeline_inputs(b) for b in micro]))
        seconds = time.perf_counter() - start
        record = {"step": step, "loss": float(value), "step_time_s": seconds,
                  "micro_batches": gas, "dp_rank": dp_rank, "stage": engine.stage_id,
                  "tokens": sum(b["num_tokens"] for b in micro),
                  "plan_steps": [b["step"] for b in micro],
                  "sample_ids": [b["sample_ids"].tolist() for b in micro]}
        if logs:
            logs.write(json.dumps(record) + "\n")
            logs.flush()
    if logs:
        logs.close()


def _open_logs(cfg: TrainConfig, engine, dp_rank: int):
    """Rank (stage 0, dp d) writes ``data-dpD.jsonl``; global rank 0's is ``train_log.jsonl``."""
    if not engine.is_first_stage():
        return None
    os.makedirs(cfg.out, exist_ok=True)
    name = "train_log.jsonl" if engine.global_rank == 0 else f"train_log-dp{dp_rank}.jsonl"
    return open(os.path.join(cfg.out, name), "w", encoding="utf-8")


def main() -> None:
    """Entry point under the DeepSpeed launcher: ``python -m train.trainer [--local_rank=N]
    CONFIG_JSON`` (the launcher adds ``--local_rank``; the rank comes from the environment)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                                                    "%(message)s")
    config_path = [a for a in sys.argv[1:] if not a.startswith("--local_rank")][0]
    with open(config_path, encoding="utf-8") as f:
        run(TrainConfig(**json.load(f)))


if __name__ == "__main__":
    main()

