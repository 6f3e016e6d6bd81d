"""The training loop each DeepSpeed process runs (started by ``vlmshard train`` through the
DeepSpeed launcher): stream this data-parallel rank's shards, one packed micro-batch per pipeline
micro-step, Ave-Token loss, a JSON line per step. The loop is the same for both engines it runs
(the pipeline's and ZeRO-2/3's), which sit behind ``vlmshard.train.engine.TrainEngine``.

Every step takes ``micro_batches × V/W`` records from the rank's loader (the plan's step), so the
pipeline's gradient accumulation is the plan's micro-batches. Only first stages read shards; the
labels travel with the activations to the last stage, and the step's supervised-token count is
summed over the world.

A barrier after loading starts every rank's step clock together: a rank's ``wait_s`` (step time
less its own forward and backward) is then the time it lost to other ranks' compute and to the
pipeline's bubbles, not to its own data loading, which is logged apart as ``load_s``; its
``pipeline_s`` (step start to the end of its last backward) tells the pipeline's bubbles from the
data-parallel waiting and the all-reduce that follow. Rank 0 also writes ``pipeline.json``: the
layers each stage held, so the run can be replayed by the simulator.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import IO, TYPE_CHECKING, ContextManager, Iterator

import vlmshard.io
from vlmshard.errors import ConfigError, InputError
from vlmshard.io import write_json_atomic
from vlmshard.model_sizes import CostTerms, ModelConfig, training_flops
from vlmshard.process import set_up_logging, skip_collection_at_exit
from vlmshard.run_log import PIPELINE_NAME

from .collector import StepCollector
from .config import TrainConfig
from .deepspeed_compat import route_logging
from .default_partition import ChosenPartition, Device, choose_partition
from .distributed import from_first_stage, init_distributed, on_rank_0, rank_device, to_rank_0
from .trace import sampled_step, traced_step
from .train_log import (
    open_log,
    pipeline_record,
    rank_data,
    rank_timing,
    recompute_flops,
    step_record,
    write_record,
)

if TYPE_CHECKING:
    import torch

    from .engine import TrainEngine
    from .hf_model import ModelLayers
    from .topology import Topology

log = logging.getLogger(__name__)


def cpu_threads_per_rank(processes: int) -> int:
    """Intra-op threads for one of ``processes`` ranks sharing this machine's CPUs: more would
    oversubscribe the cores and make every rank's time depend on its neighbours'.
    ``OMP_NUM_THREADS``, where set, caps it (the machine is shared with other jobs)."""
    share = max(1, vlmshard.io.available_cpus() // processes)
    cap = os.environ.get("OMP_NUM_THREADS", "")
    return min(share, int(cap)) if cap.isdigit() and int(cap) > 0 else share


def gpu_rank_threads(loader_workers: int) -> int:
    """Intra-op threads for a GPU rank: its share of the node's CPUs, each of its loader workers
    counted as a process beside it (``LOCAL_SIZE``: the ranks on this node, as DeepSpeed's
    launcher sets it). A GPU rank's own CPU work is small and on the critical path: each
    micro-batch's positions and boundaries, computed before its kernels launch. OpenMP threads
    beyond the share wait for each other at barriers while the workers hold the cores
    (``benchmarks/host_overhead_bench.py --contention``)."""
    local = int(os.environ.get("LOCAL_SIZE", 1))
    return cpu_threads_per_rank(local * (1 + loader_workers))


def check_shards_fit(dataset, model) -> None:
    """The shards were made for this model: its family, image token, tokens per tile and
    vocabulary (a mismatch would train on garbage, or fail deep inside a layer)."""
    m = dataset.manifest
    config = model.config
    vocab = config.get_text_config().vocab_size
    problems = []
    if dataset.family.name != model.family:
        problems.append(f"they hold {dataset.family.name} data, the model is {model.family}")
    if m.image_token_id != config.image_token_id:
        problems.append(f"their image token is {m.image_token_id}, the model's "
                        f"{config.image_token_id}")
    tokens = {p.tokens_per_tile for p in dataset.policies.values()}
    if tokens != {model.geometry.tokens_per_tile}:
        problems.append(f"they were tokenized with {sorted(tokens)} tokens per tile, the model "
                        f"makes {model.geometry.tokens_per_tile}")
    if m.pad_token_id >= vocab:
        problems.append(f"their pad token {m.pad_token_id} is outside the model's vocabulary "
                        f"of {vocab}")
    if problems:
        raise InputError(f"{dataset.root} do not fit {model.path}: " + "; ".join(problems)
                         + " (preprocess with --model the folder you train)")


def check_vocabulary(batch: dict, vocab_size: int) -> dict:
    """The batch, if every token id has an embedding."""
    largest = int(batch["input_ids"].max())
    if largest >= vocab_size:
        raise InputError(f"the shards hold token id {largest}, but the model's vocabulary has "
                         f"{vocab_size} entries")
    return batch


def repeated(cfg: TrainConfig, rank: int, start: int, cuda: bool) -> Iterator[dict]:
    """This data-parallel rank's micro-batches from global step ``start`` on, from step 0 again
    after the last step: the data position is a pure function of the step."""
    from vlmshard.shards.loader import ShardDataset, make_loader

    steps = ShardDataset(cfg.shards, rank, cfg.dp).steps
    first = start % steps
    while True:
        yield from make_loader(cfg.shards, rank, cfg.dp, first, num_workers=cfg.loader_workers,
                               pin_memory=cuda, pixel_dtype=cfg.dtype, pad_pixels=False)
        first = 0


@dataclass
class Setup:
    """What every rank knows before it builds its engine."""

    device: torch.device
    model: ModelLayers
    topology: Topology
    chosen: ChosenPartition
    micro_batches: int  # per step: the plan's, the engine's gradient accumulation
    steps: int
    sizes: ModelConfig  # the model's analytic sizes

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def set_up(cfg: TrainConfig) -> Setup:
    """Join the world, read the model folder and the shards, and take one partition for all
    ranks (rank 0's)."""
    import torch

    from vlmshard.shards.loader import ShardDataset

    from .hf_model import rank_model
    from .sequence_parallel import check_model
    from .topology import Topology

    cuda = torch.cuda.is_available()
    cfg.resolve_device_defaults(cuda)
    device = rank_device(cuda)  # before anything touches CUDA
    init_distributed(cuda)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 runs: TF32 tensor cores
        torch.backends.cudnn.allow_tf32 = True
        torch.set_num_threads(gpu_rank_threads(cfg.loader_workers))
    else:
        torch.set_num_threads(cpu_threads_per_rank(cfg.pp * cfg.dp))
    log.info("intra-op threads: %d (CPUs here: %d)", torch.get_num_threads(),
             vlmshard.io.available_cpus())
    torch.manual_seed(cfg.seed)
    probe = ShardDataset(cfg.shards, 0, cfg.dp)
    if not cfg.model:  # the launcher resolves and checks it once, before starting the processes
        raise ConfigError("the training config names no model folder: start training with "
                          "`vlmshard train`")
    degrees = probe.manifest.sp_degrees
    model = rank_model(cfg, device, max(degrees) > 1)
    log.info("attention backend: %s (vlmshard.train.attention)", model.backend)
    if cfg.compile_blocks and cfg.liger:
        log.info("--compile-blocks: Inductor fuses the compiled blocks' norms, activations and "
                 "rotary embeddings; Liger's kernels run in the layers not compiled")
    check_shards_fit(probe, model)
    check_model(model, probe.manifest, pp=cfg.pp, dp=cfg.dp)
    topology = Topology.build(cfg.pp, cfg.dp, degrees, device.type)  # every rank, in step
    chosen = on_rank_0(lambda: choose_partition(
        cfg, model, Device.of_rank(device), int(os.environ.get("LOCAL_SIZE", 1))), topology)
    log.info("partition: bounds %s, recompute %s, selective %s; %s", chosen.bounds,
             chosen.recompute or "none", chosen.selective or "none", chosen.source)
    sizes = model.sizes()
    return Setup(device, model, topology, chosen, probe.micro_batches_per_step,
                 cfg.max_steps or probe.steps, sizes)


def write_pipeline(cfg: TrainConfig, setup: Setup, engine: TrainEngine) -> None:
    """``pipeline.json`` from every rank's stage layers (a collective; rank 0 writes it)."""
    stages = to_rank_0(engine.stage_layers(), setup.topology)
    if stages is not None:
        chosen = setup.chosen
        write_json_atomic(os.path.join(cfg.out, PIPELINE_NAME),
                          pipeline_record(setup.sizes.to_dict(), stages, chosen.source,
                                          chosen.memory, chosen.budget_bytes,
                                          setup.model.backend, asdict(setup.model.kernels),
                                          asdict(setup.model.saves()),
                                          dict(zip(setup.model.names, setup.model.modes))))


def rank_0_log(cfg: TrainConfig, engine: TrainEngine, first_step: int
               ) -> ContextManager[IO[str] | None]:
    """``train_log.jsonl`` on global rank 0 (``train_log.open_log``), nothing elsewhere."""
    if engine.global_rank == 0:
        return open_log(cfg.out, first_step)
    return contextlib.nullcontext()


def checkpoint_due(cfg: TrainConfig, completed: int, steps: int) -> bool:
    """Whether a checkpoint follows the ``completed``-th step: every ``checkpoint_every`` and
    the last."""
    return cfg.save_checkpoints and (
        bool(cfg.checkpoint_every) and completed % cfg.checkpoint_every == 0
        or completed == steps)


@dataclass(frozen=True)
class StepShared:
    """What every step of a run shares, set up once before the first."""

    batches: Iterator[dict] | None  # this rank's micro-batches (first stages only)
    vocab: int  # the LLM's vocabulary, each micro-batch's tokens checked against it
    flops: CostTerms  # the model's training FLOPs per size (``training_flops``)
    recomputed_flops: CostTerms  # what the chosen recompute adds (``recompute_flops``)
    traced: int | None  # --trace: the step under the profiler (the next one host-sampled)


def run_steps(cfg: TrainConfig, setup: Setup, engine: TrainEngine, first_step: int,
              log_file: IO[str] | None) -> None:
    """Steps ``first_step`` to the last (``run_step``), Python's garbage collected between
    them only (``StepCollector``)."""
    shared = StepShared(
        batches=(repeated(cfg, engine.dp_rank, first_step, setup.cuda) if engine.reads_data
                 else None),
        vocab=setup.model.config.get_text_config().vocab_size,
        flops=training_flops(setup.sizes, cfg.recipe),
        recomputed_flops=recompute_flops(setup.model.names, setup.model.analytic_work(),
                                         setup.model.modes, setup.chosen.recompute),
        traced=first_step + 1 if cfg.trace else None)
    with StepCollector(cfg.gc_every) as collector:
        for step in range(first_step, setup.steps):
            run_step(cfg, setup, engine, step, shared, log_file)
            collector.after_step(step + 1)


def run_step(cfg: TrainConfig, setup: Setup, engine: TrainEngine, step: int,
             shared: StepShared, log_file: IO[str] | None) -> None:
    """One step: load its micro-batches (first stages) and share their sizes, step the engine,
    gather every rank's timings to rank 0's log, checkpoint when due."""
    import torch

    from .micro import HostMeta
    from .pipeline import pipeline_inputs

    reads, traced = engine.reads_data, shared.traced
    start = time.perf_counter()
    micro = [check_vocabulary(next(shared.batches), shared.vocab)
             for _ in range(setup.micro_batches)] if reads else []
    inputs = [pipeline_inputs(b, engine.device) for b in micro]
    # Each micro-batch's sizes, from the first stage to the others on the host
    hosts = from_first_stage(
        [HostMeta.of_batch(b, setup.model.geometry) for b in micro] if reads else None,
        setup.topology)
    # The Ave-Token denominator: the first stages' counts, summed over the whole world
    tokens = torch.tensor([sum(h.supervised for h in hosts) if reads else 0])
    torch.distributed.all_reduce(tokens, group=setup.topology.world)
    load_s = time.perf_counter() - start
    with traced_step(cfg.trace, engine.global_rank, step, setup.cuda, step == traced), \
            sampled_step(cfg.trace, engine.global_rank, step,
                         cfg.trace is not None and step == traced + 1):
        result = engine.step(inputs, hosts, int(tokens))
    times = result.times
    timing = rank_timing(rank=engine.global_rank, stage=engine.stage_id,
                         dp_rank=engine.dp_rank, forward_s=times.forward_s,
                         backward_s=times.backward_s, pipeline_s=times.pipeline_s,
                         step_time_s=result.seconds, load_s=load_s, parts=times.parts,
                         recompute_s=times.recompute_s, optimizer_s=times.optimizer_s,
                         host=times.host)
    timing.update(result.extra)
    if reads:
        timing["data"] = rank_data(micro, setup.sizes)
    every_rank = to_rank_0(timing, setup.topology)
    if log_file:
        record = step_record(step, result.loss, result.lr, every_rank, shared.flops,
                             shared.recomputed_flops)
        record["sp"] = micro[0]["shard"].sp if reads and "shard" in micro[0] else 1
        if step == traced:  # profiled: its times hold the profiler's overhead
            record["traced"] = True
        write_record(log_file, record)
    if checkpoint_due(cfg, step + 1, setup.steps):
        engine.save(os.path.join(cfg.out, "checkpoints"), step + 1)


def leave() -> None:
    """Leave together and join the communication threads before the interpreter exits: a rank
    torn down while gloo still runs aborts with "terminate called without an active
    exception"."""
    import torch

    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def run_rank(cfg: TrainConfig) -> None:
    """One rank's run: set up, build the engine, resume, run the steps, save, leave."""
    from .engine import build_engine

    setup = set_up(cfg)
    engine = build_engine(cfg, setup.model, setup.chosen, device=setup.device,
                          topology=setup.topology, micro_batches=setup.micro_batches,
                          steps=setup.steps)
    first_step = engine.load(os.path.join(cfg.resume, "checkpoints")) if cfg.resume else 0
    write_pipeline(cfg, setup, engine)
    with rank_0_log(cfg, engine, first_step) as log_file:
        run_steps(cfg, setup, engine, first_step, log_file)
    if cfg.save_checkpoints:
        engine.write_model(cfg.out)
    leave()


def main() -> None:
    """Entry point under the DeepSpeed launcher: ``python -m vlmshard.train.trainer
    [--local_rank=N] [--log-level=LEVEL] CONFIG_JSON`` (the launcher adds ``--local_rank``; the
    rank comes from the environment; the level is the launching command's, ``-q``'s
    ``WARNING`` among them)."""
    skip_collection_at_exit()
    parser = argparse.ArgumentParser(prog="vlmshard.train.trainer")
    parser.add_argument("--local_rank", type=int)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("config")
    args = parser.parse_args()
    set_up_logging(args.log_level)
    route_logging()
    with open(args.config, encoding="utf-8") as f:
        run_rank(TrainConfig(**json.load(f)))


if __name__ == "__main__":
    main()

