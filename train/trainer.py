"""The training loop each DeepSpeed process runs (started by ``vlmshard train`` through the
DeepSpeed launcher): stream this data-parallel rank's shards, one packed micro-batch per pipeline
micro-step, Ave-Token loss, a JSON line per step.

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

import json
import logging
import os
import sys
import time
from typing import Iterator

from vlmshard.errors import ConfigError, InputError
from vlmshard.io import read_json, write_json_atomic
from vlmshard.model_sizes import training_flops
from vlmshard.run_log import PIPELINE_NAME

from .config import TrainConfig
from .default_partition import Device, choose_partition
from .distributed import (
    from_first_stage,
    init_distributed,
    on_rank_0,
    rank_device,
    side_groups,
)
from .engine_memory import engine_bytes, on_first_step
from .train_log import (
    open_log,
    pipeline_record,
    rank_data,
    rank_timing,
    step_record,
    write_record,
)

log = logging.getLogger(__name__)


def cpu_threads_per_rank(processes: int) -> int:
    """Intra-op threads for one of ``processes`` ranks sharing this machine's CPUs: more would
    oversubscribe the cores and make every rank's time depend on its neighbours'."""
    from vlmshard.io import available_cpus

    return max(1, available_cpus() // processes)


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


def deepspeed_config(cfg: TrainConfig, gas: int) -> dict:
    """The engine's configuration: one packed micro-batch per pipeline micro-step, the plan's
    micro-batches as gradient accumulation. bf16 with gradients accumulated in fp32 takes
    DeepSpeed's BF16 optimizer: fp32 master weights and Adam states sharded over the
    data-parallel ranks (the ZeRO-1 setting is how DeepSpeed selects it under pipeline
    parallelism). ``--grad-accum bf16`` (in bf16, DeepSpeed's own warning says, many
    accumulation steps are not safe) takes DeepSpeed's ZeRO-1 optimizer instead, for up to 4
    bytes per parameter less (``model_sizes.bytes_per_param``)."""
    config = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
        "train_batch_size": gas * cfg.dp, "steps_per_print": 10 ** 9,
        "gradient_clipping": cfg.max_grad_norm,
    }
    if cfg.precision == "bf16":
        config["bf16"] = {"enabled": True}
        config["data_types"] = {"grad_accum_dtype": cfg.grad_accum}
        config["zero_optimization"] = {"stage": 1}
    if cfg.zero > 1:  # the plain engine (--pp 1); torch's AdamW is a "client" optimizer to it
        config["zero_optimization"] = {"stage": cfg.zero}
        config["zero_allow_untested_optimizer"] = True
    return config


def run(cfg: TrainConfig) -> None:
    import deepspeed
    import torch
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
    from transformers import get_scheduler

    from vlmshard.families import model_sizes
    from vlmshard.shards.loader import ShardDataset

    from .attention import choose_backend
    from .clock import CLOCK, HostSyncs
    from .data_parallel import VLMModel, train_batch
    from .hf_model import model_layers
    from .micro import HostMeta
    from .pipeline import AveTokenLoss, VLMPipeline, no_inputs, pipeline_inputs
    from .save import save_hf, save_hf_data_parallel

    cuda = torch.cuda.is_available()
    cfg.resolve_device_defaults(cuda)
    device = rank_device(cuda)  # before anything touches CUDA
    init_distributed(cuda)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 runs: TF32 tensor cores
        torch.backends.cudnn.allow_tf32 = True
    else:
        torch.set_num_threads(cpu_threads_per_rank(cfg.pp * cfg.dp))
    CLOCK.use_cuda(cuda)
    torch.manual_seed(cfg.seed)
    probe = ShardDataset(cfg.shards, 0, cfg.dp)
    if not cfg.model:  # the launcher resolves and checks it once, before starting the processes
        raise ConfigError("the training config names no model folder: start training with "
                          "`vlmshard train`")
    model = model_layers(cfg.model, choose_backend(device, cfg.dtype))
    log.info("attention backend: %s (vlmshard.train.attention)", model.backend)
    check_shards_fit(probe, model)
    gas = probe.micro_batches_per_step
    steps = cfg.max_steps or probe.steps
    topology = PipeDataParallelTopology(num_pp=cfg.pp, num_dp=cfg.dp)
    groups = side_groups(topology)
    chosen = on_rank_0(lambda: choose_partition(
        cfg, model, Device.of_rank(device), int(os.environ.get("LOCAL_SIZE", 1))), groups)
    log.info("partition: bounds %s, recompute %s, selective %s; %s", chosen.bounds,
             chosen.recompute or "none", chosen.selective or "none", chosen.source)

    loss = AveTokenLoss()
    pipelined = cfg.zero == 1
    if pipelined:
        net = VLMPipeline(model, cfg.pp, loss, backend=model.backend, dtype=cfg.dtype,
                          device=device, bounds=chosen.bounds, recompute=set(chosen.recompute),
                          selective=set(chosen.selective), topology=topology)
    else:
        net = VLMModel(model, loss, device=device, dtype=cfg.dtype,
                       recompute=set(chosen.recompute), selective=set(chosen.selective))
        if cfg.zero == 3:
            net.register_external_weights()
    trained = [p for p in net.parameters() if p.requires_grad]
    # torch's own AdamW (fused kernels): DeepSpeed's "AdamW" compiles its fused_adam op on
    # first use (nvcc on GPU, minutes of ninja on CPU).
    optimizer = torch.optim.AdamW(trained, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  fused=True)
    # Hugging Face's schedules, stepped by DeepSpeed after each optimizer step and saved with
    # its checkpoints (a resumed run continues the schedule)
    schedule = get_scheduler(cfg.lr_scheduler_type, optimizer,
                             num_warmup_steps=cfg.warmup_steps_of(steps),
                             num_training_steps=steps)
    log.info("lr %g, %s schedule over %d steps, %d warm-up", cfg.lr, cfg.lr_scheduler_type,
             steps, cfg.warmup_steps_of(steps))
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=trained,
                                           optimizer=optimizer, lr_scheduler=schedule,
                                           config=deepspeed_config(cfg, gas))
    loss.scale = gas * cfg.dp
    # What the engine holds for its parameters, counted once, in the first step's optimizer
    # update (the memory model's bytes per parameter are checked against it)
    held: dict = {}
    on_first_step(optimizer, lambda: held.update(engine_bytes(engine, trained)))
    # the order of the optimizer's parameters, saved with each checkpoint: which rank holds what
    trained_names = [n for n, p in net.named_parameters() if p.requires_grad]
    checkpoints = os.path.join(cfg.out, "checkpoints")
    first_step = 0
    if cfg.resume:
        _, state = engine.load_checkpoint(os.path.join(cfg.resume, "checkpoints"))
        if state is None:
            raise FileNotFoundError(f"{cfg.resume}: no checkpoint to resume from")
        first_step = state["step"]

    def save(folder: str) -> None:
        if pipelined:
            save_hf(net, engine, folder)
        else:
            save_hf_data_parallel(net, cfg.zero, folder)

    dp_rank = engine.grid.get_data_parallel_id() if pipelined else engine.global_rank
    stage_id = engine.stage_id if pipelined else 0
    reads = engine.is_first_stage() if pipelined else True
    batches = repeated(cfg, dp_rank, first_step, cuda) if reads else None
    log_file = open_log(cfg.out, first_step) if engine.global_rank == 0 else None
    sizes = model_sizes(read_json(os.path.join(model.path, "config.json")), model.path)
    flops = training_flops(sizes)
    stages = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(stages, (stage_id, net.stage_layer_names, [
        n for n, mode in zip(net.stage_layer_names, net.recompute) if mode == "full"], [
        n for n, mode in zip(net.stage_layer_names, net.recompute) if mode == "selective"]))
    if engine.global_rank == 0:
        write_json_atomic(os.path.join(cfg.out, PIPELINE_NAME),
                          pipeline_record(sizes.to_dict(), stages, chosen.source,
                                          chosen.memory, chosen.budget_bytes))
    vocab = model.config.get_text_config().vocab_size
    for step in range(first_step, steps):
        start = time.perf_counter()
        micro = [check_vocabulary(next(batches), vocab) for _ in range(gas)] if reads else []
        inputs = [pipeline_inputs(b, engine.device) for b in micro] or \
            [no_inputs() for _ in range(gas)]
        # Each micro-batch's sizes, from the first stage to the others on the host
        hosts = from_first_stage([HostMeta.of_batch(b) for b in micro] if reads else None,
                                 groups)
        # The Ave-Token denominator: the first stages' counts, summed over the whole world
        tokens = torch.tensor([sum(h.supervised for h in hosts) if reads else 0])
        torch.distributed.all_reduce(tokens, group=groups.world)
        loss.global_tokens = int(tokens)
        load_s = time.perf_counter() - start
        torch.distributed.barrier()  # the step's clock starts on every rank together
        start = time.perf_counter()
        CLOCK.start_step()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        lr = schedule.get_last_lr()[0]  # this step's: DeepSpeed steps the schedule after it
        with HostSyncs(cfg.count_host_syncs) as syncs:
            if pipelined:
                net.expect(hosts)
                value = engine.train_batch(iter(inputs))
            else:
                value = train_batch(engine, inputs, hosts)
        value = float(value)
        times = CLOCK.take()  # synchronises: the step ends when the device is done with it
        seconds = time.perf_counter() - start
        mine = rank_timing(rank=engine.global_rank, stage=stage_id, dp_rank=dp_rank,
                           forward_s=times.forward_s, backward_s=times.backward_s,
                           pipeline_s=times.pipeline_s, step_time_s=seconds, load_s=load_s)
        if cuda:
            mine["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
            mine["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        if syncs.enabled:
            mine["host_syncs"] = syncs.count
        if held:
            mine["engine_bytes"] = dict(held)
            held.clear()
        if reads:
            mine["data"] = rank_data(micro, sizes.llm.sliding_window)
        ranks = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(ranks, mine, group=groups.world)
        if log_file:
            write_record(log_file, step_record(step, value, lr, ranks, flops))
        if cfg.save_checkpoints and (
                cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0
                or step + 1 == steps):
            tag = f"step-{step + 1}"
            engine.save_checkpoint(checkpoints, tag=tag, client_state={
                "step": step + 1, "parameters": trained_names})
            save(os.path.join(checkpoints, tag, "hf"))
    if cfg.save_checkpoints:
        save(os.path.join(cfg.out, "hf"))
    if log_file:
        log_file.close()
    # Leave together and join the communication threads before the interpreter exits: a rank
    # torn down while gloo still runs aborts with "terminate called without an active exception".
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    """Entry point under the DeepSpeed launcher: ``python -m vlmshard.train.trainer
    [--local_rank=N] CONFIG_JSON`` (the launcher adds ``--local_rank``; the rank comes from the
    environment)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                                                    "%(message)s")
    config_path = [a for a in sys.argv[1:] if not a.startswith("--local_rank")][0]
    with open(config_path, encoding="utf-8") as f:
        run(TrainConfig(**json.load(f)))


if __name__ == "__main__":
    main()

