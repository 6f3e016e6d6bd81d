"""The training loop each DeepSpeed process runs (started by ``vlmshard train`` through the
DeepSpeed launcher): stream this data-parallel rank's shards, one packed micro-batch per pipeline
micro-step, Ave-Token loss, a JSON line per step.

Every step takes ``micro_batches × V/W`` records from the rank's loader (the plan's step), so the
pipeline's gradient accumulation is the plan's micro-batches. The first stage decodes images;
the last stage reads the same records without pixels, for the labels and the token count.

A barrier after loading starts every rank's step clock together: a rank's ``wait_s`` (step time
less its own forward and backward) is then the time it lost to other ranks' compute and to the
pipeline's bubbles, not to its own data loading.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator

from vlmshard.model_sizes import Size, training_flops

from .config import TrainConfig

log = logging.getLogger(__name__)


def supervised_tokens(batch: dict) -> int:
    """Tokens with a next-token target in this micro-batch (the Ave-Token denominator's share)."""
    from .model import IGNORE_INDEX, next_token_targets

    return int((next_token_targets(batch["labels"], batch["position_ids"]) != IGNORE_INDEX).sum())


def micro_batch_size(batch: dict) -> dict:
    """The three sizes the cost model and the simulator read: tiles, tokens, Σseq_len²."""
    import numpy as np

    lens = np.diff(np.asarray(batch["cu_seqlens"][:batch["num_samples"] + 1], dtype=np.int64))
    return {"tiles": int(batch["num_tiles"]), "tokens": int(batch["num_tokens"]),
            "squares": int((lens ** 2).sum())}


def cpu_threads_per_rank(processes: int) -> int:
    """Intra-op threads for one of ``processes`` ranks sharing this machine's CPUs: more would
    oversubscribe the cores and make every rank's time depend on its neighbours'."""
    from vlmshard.io import available_cpus

    return max(1, available_cpus() // processes)


def check_vocabulary(batch: dict, vocab_size: int) -> dict:
    """The batch, if every token id has an embedding (a real-size preset's vocabulary can be
    smaller than the tokenizer the shards were made with)."""
    largest = int(batch["input_ids"].max())
    if largest >= vocab_size:
        raise ValueError(f"the shards hold token id {largest}, but the model's vocabulary has "
                         f"{vocab_size} entries; set model.llm.vocab_size to the tokenizer's")
    return batch


def repeated(shards: str, rank: int, world: int, pixels: bool, start: int) -> Iterator[dict]:
    """This rank's micro-batches from global step ``start`` on, from step 0 again after the
    last step: the data position is a pure function of the step."""
    from vlmshard.shards.loader import ShardDataset

    steps = ShardDataset(shards, rank, world).steps
    first = start % steps
    while True:
        yield from ShardDataset(shards, rank, world, start_step=first, pixels=pixels)
        first = 0


def run(cfg: TrainConfig) -> None:
    import deepspeed
    import torch
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    from vlmshard.shards.loader import ShardDataset

    from vlmshard.model_sizes import ModelConfig
    from .pipeline import CLOCK, AveTokenLoss, build_pipeline, pipeline_inputs

    cfg.validate()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    if not torch.cuda.is_available():
        torch.set_num_threads(cpu_threads_per_rank(cfg.pp * cfg.dp))
    torch.manual_seed(cfg.seed)
    model_config = ModelConfig.from_dict(cfg.model)
    probe = ShardDataset(cfg.shards, 0, cfg.dp)
    shard_tokens = {p.tokens_per_tile for p in probe.policies.values()}
    if shard_tokens != {model_config.tokens_per_tile}:
        raise ValueError(f"the model makes {model_config.tokens_per_tile} tokens per tile; the "
                         f"shards were tokenized with {sorted(shard_tokens)}")
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
    checkpoints = os.path.join(cfg.out, "checkpoints")
    first_step = 0
    if cfg.resume:
        _, state = engine.load_checkpoint(os.path.join(cfg.resume, "checkpoints"))
        if state is None:
            raise FileNotFoundError(f"{cfg.resume}: no checkpoint to resume from")
        first_step = state["step"]
    dp_rank = engine.grid.get_data_parallel_id()
    reads = engine.is_first_stage() or engine.is_last_stage()
    batches = repeated(cfg.shards, dp_rank, cfg.dp, engine.is_first_stage(), first_step)
    log_file = _open_log(cfg, engine.global_rank, append=first_step > 0)
    flops = training_flops(model_config)  # per tile, token and squared length
    for step in range(first_step, steps):
        micro = [check_vocabulary(next(batches), model_config.llm.vocab_size)
                 for _ in range(gas)] if reads else []
        tokens = torch.tensor([sum(supervised_tokens(b) for b in micro)], dtype=torch.long)
        if engine.is_last_stage():
            deepspeed.comm.all_reduce(tokens, group=engine.grid.get_data_parallel_group())
            loss.global_tokens = int(tokens)
        torch.distributed.barrier()  # the step's clock starts on every rank together
        CLOCK.take()
        start = time.perf_counter()
        value = float(engine.train_batch(iter([pipeline_inputs(b) for b in micro])))
        seconds = time.perf_counter() - start
        forward, backward = CLOCK.take()
        mine = {"rank": engine.global_rank, "stage": engine.stage_id, "dp_rank": dp_rank,
                "forward_s": forward, "backward_s": backward,
                "wait_s": max(0.0, seconds - forward - backward), "step_time_s": seconds}
        if engine.is_first_stage():
            mine["data"] = {"tokens": sum(b["num_tokens"] for b in micro),
                            "plan_steps": [b["step"] for b in micro],
                            "micro_sizes": [micro_batch_size(b) for b in micro],
                            "sample_ids": [b["sample_ids"].tolist() for b in micro]}
        ranks = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(ranks, mine)
        if log_file:
            record = _step_record(step, value, ranks, flops)
            log_file.write(json.dumps(record) + "\n")
            log_file.flush()
        if cfg.save_checkpoints and (
                cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0
                or step + 1 == steps):
            engine.save_checkpoint(checkpoints, tag=f"step{step + 1:08d}",
                                   client_state={"step": step + 1})
    if log_file:
        log_file.close()
    # Leave together and join the communication threads before the interpreter exits: a rank
    # torn down while gloo still runs aborts with "terminate called without an active exception".
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _step_record(step: int, loss: float, ranks: list[dict], flops: Size) -> dict:
    """One line of train_log.jsonl from every rank's timings and the first stages' data.

    ``model_flops`` is the step's useful training work (forward + backward of the real tiles,
    tokens and per-sample attention, padding excluded) from the model's analytic FLOPs: divided
    by step time and the cluster's peak it is the MFU."""
    seconds = max(r["step_time_s"] for r in ranks)
    data = sorted((r for r in ranks if "data" in r), key=lambda r: r["dp_rank"])
    tokens = sum(r["data"]["tokens"] for r in data)
    model_flops = sum(flops.dot(Size(**m)) for r in data for m in r["data"]["micro_sizes"])
    return {"step": step, "loss": loss, "step_time_s": seconds, "tokens": tokens,
            "tokens_per_s": tokens / seconds if seconds else 0.0,
            "model_flops": model_flops,
            "model_flops_per_s": model_flops / seconds if seconds else 0.0,
            "ranks": [{k: v for k, v in r.items() if k != "data"} for r in ranks],
            "data": [{"dp_rank": r["dp_rank"], **r["data"]} for r in data]}


def _open_log(cfg: TrainConfig, global_rank: int, append: bool):
    """Global rank 0 writes ``train_log.jsonl`` (appending when resuming)."""
    if global_rank != 0:
        return None
    os.makedirs(cfg.out, exist_ok=True)
    return open(os.path.join(cfg.out, "train_log.jsonl"), "a" if append else "w",
                encoding="utf-8")


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

