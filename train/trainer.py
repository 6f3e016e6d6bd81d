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
from typing import Iterator

from vlmshard.model_sizes import training_flops

from .config import TrainConfig
from .train_log import open_log, rank_data, rank_timing, step_record, write_record

log = logging.getLogger(__name__)


def supervised_tokens(batch: dict) -> int:
    """Tokens with a next-token target in this micro-batch (the Ave-Token denominator's share)."""
    from vlmshard.preprocess.tokenize import IGNORE_INDEX

    from .model import next_token_targets

    return int((next_token_targets(batch["labels"], batch["position_ids"]) != IGNORE_INDEX).sum())


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
    if probe.rows_per_tile != 1 or probe.takes_grids:
        raise ValueError(f"{cfg.shards} hold {probe.family.name} pixels (flattened patches and "
                         "grids); this trainer's model takes InternVL-style tiles")
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
    log_file = open_log(cfg.out, first_step) if engine.global_rank == 0 else None
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
        mine = rank_timing(rank=engine.global_rank, stage=engine.stage_id, dp_rank=dp_rank,
                           forward_s=forward, backward_s=backward, step_time_s=seconds)
        if engine.is_first_stage():
            mine["data"] = rank_data(micro)
        ranks = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(ranks, mine)
        if log_file:
            write_record(log_file, step_record(step, value, ranks, flops))
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

