"""The two DeepSpeed engines the trainer runs, behind one interface: build, step, save, load.

``--zero 1`` (any ``--pp``) takes DeepSpeed's ``PipelineEngine`` over ``VLMPipeline``
(``vlmshard.train.pipeline``); ``--zero 2`` and ``3`` (``--pp 1``) its plain engine over
``VLMModel`` (``vlmshard.train.data_parallel``). Both train the same layers with the same
optimizer, schedule and Ave-Token loss, and the training loop (``vlmshard.train.trainer``) asks
only what ``TrainEngine`` offers: where this rank sits, the layers its stage holds, one timed
step, checkpoints and the Hugging Face folder. Each engine owns its ``StageClock``: the layers
it builds time themselves on it.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from .clock import HostSyncs, StageClock, StageTimes, allocator_calls
from .config import TrainConfig
from .data_parallel import VLMModel, train_batch
from .deepspeed_compat import (
    clip_over_every_stage,
    fewer_host_syncs,
    prints_logged,
    skip_frozen_gradients,
    zero3_linear_bias_out_of_place,
)
from .default_partition import ChosenPartition
from .engine_memory import GatheredWeights, engine_bytes, on_first_step
from .hf_model import ModelLayers
from .kernels import COMPILES
from .micro import HostMeta
from .pipeline import AveTokenLoss, VLMPipeline, no_inputs
from .save import save_hf, save_hf_data_parallel
from .topology import Topology

log = logging.getLogger(__name__)


def deepspeed_config(cfg: TrainConfig, gas: int) -> dict:
    """The engine's configuration: one packed micro-batch per pipeline micro-step, the plan's
    micro-batches as gradient accumulation. bf16 with gradients accumulated in fp32 takes
    DeepSpeed's BF16 optimizer: fp32 master weights and Adam states sharded over the
    data-parallel ranks (the ZeRO-1 setting is how DeepSpeed selects it under pipeline
    parallelism). ``--grad-accum bf16`` (in bf16, DeepSpeed's own warning says, many
    accumulation steps are not safe) takes DeepSpeed's ZeRO-1 optimizer instead, for up to 4
    bytes per parameter less (``model_sizes.bytes_per_param``). DeepSpeed's throughput timer
    is off: it synchronises the device around each micro-batch (the engine's ``StageClock``
    times the step without), and so is its ``wall_clock_breakdown``."""
    config = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
        "train_batch_size": gas * cfg.dp, "steps_per_print": 10 ** 9,
        "gradient_clipping": cfg.max_grad_norm,
        "timers": {"throughput": {"enabled": False}}, "wall_clock_breakdown": False,
    }
    if cfg.precision == "bf16":
        config["bf16"] = {"enabled": True}
        config["data_types"] = {"grad_accum_dtype": cfg.grad_accum}
        config["zero_optimization"] = {"stage": 1}
    if cfg.zero > 1:  # the plain engine (--pp 1); torch's AdamW is a "client" optimizer to it
        config["zero_optimization"] = {"stage": cfg.zero}
        if cfg.zero3_persistence_threshold is not None:
            config["zero_optimization"]["stage3_param_persistence_threshold"] = \
                cfg.zero3_persistence_threshold
        config["zero_allow_untested_optimizer"] = True
    return config


def learning_rates(peak: float, schedule) -> Callable[[int], float]:
    """The learning rate at each step of ``schedule`` (a Hugging Face scheduler of an
    optimizer), read off its rule over an optimizer of no weights: a stage with nothing to
    train has no group whose rate it could read."""
    import torch

    rule = schedule(torch.optim.SGD([{"params": []}], lr=peak)).lr_lambdas[0]
    return lambda step: peak * rule(step)


@dataclass(frozen=True)
class StepResult:
    """One optimizer step as this rank saw it."""

    loss: float  # the per-token mean over the global batch (the same on every rank)
    lr: float  # the learning rate the step's update used
    times: StageTimes  # this rank's own forward, backward, pipeline time and their parts
    seconds: float  # from the step's start, together on every rank, to its end on the device
    # GPU peak memory and allocator calls, host syncs (when counted), engine bytes (first step)
    extra: dict


class TrainEngine(ABC):
    """A DeepSpeed engine over a model folder's layers, cut as ``chosen`` says, with torch's
    AdamW and Hugging Face's schedule over ``steps``; each step is ``micro_batches`` micro-batches
    (gradient accumulation). A subclass builds the module (``_module``), runs a step's
    micro-batches (``_train_batch``), writes the trained model (``write_model``) and says
    where this rank sits."""

    def __init__(self, cfg: TrainConfig, model: ModelLayers, chosen: ChosenPartition, *,
                 device: torch.device, topology: Topology, micro_batches: int, steps: int
                 ) -> None:
        import deepspeed
        from transformers import get_scheduler

        self.cfg = cfg
        self.micro_batches = micro_batches
        self.cuda = device.type == "cuda"
        self.clock = StageClock(self.cuda)
        self.gathered: GatheredWeights | None = None  # ZeRO-3's, for its first steps
        self.loss = AveTokenLoss()
        self.net = self._module(model, chosen, device, topology)
        trained = [p for p in self.net.parameters() if p.requires_grad]
        # torch's own AdamW (fused kernels): DeepSpeed's "AdamW" compiles its fused_adam op on
        # first use (nvcc on GPU, minutes of ninja on CPU). On a stage the recipe leaves nothing
        # to train its one group is empty, and DeepSpeed drops it: every rank still steps, as
        # DeepSpeed's collectives need.
        optimizer = torch.optim.AdamW([{"params": trained}], lr=cfg.lr,
                                      weight_decay=cfg.weight_decay, fused=True)
        self.clock.watch_optimizer(optimizer)
        # Hugging Face's schedules, built by DeepSpeed over the groups it keeps, stepped after
        # each optimizer step and saved with its checkpoints (a resumed run continues it)
        schedule = functools.partial(get_scheduler, cfg.lr_scheduler_type,
                                     num_warmup_steps=cfg.warmup_steps_of(steps),
                                     num_training_steps=steps)
        self.lr_at = learning_rates(cfg.lr, schedule)
        log.info("lr %g, %s schedule over %d steps, %d warm-up", cfg.lr, cfg.lr_scheduler_type,
                 steps, cfg.warmup_steps_of(steps))
        self.engine, _, _, _ = deepspeed.initialize(
            model=self.net, model_parameters=trained, optimizer=optimizer,
            lr_scheduler=schedule, config=deepspeed_config(cfg, micro_batches))
        self.loss.scale = micro_batches * cfg.dp
        # What the engine holds for its parameters, counted once, in the first step's optimizer
        # update (the memory model's bytes per parameter are checked against it)
        self._held: dict = {}
        on_first_step(optimizer, lambda: self._held.update(engine_bytes(self.engine, trained)))
        # the order of the optimizer's parameters, saved with each checkpoint: which rank holds
        # what
        self._trained_names = [n for n, p in self.net.named_parameters() if p.requires_grad]

    @abstractmethod
    def _module(self, model: ModelLayers, chosen: ChosenPartition, device: torch.device,
                topology: Topology) -> torch.nn.Module:
        """The module DeepSpeed wraps: this rank's layers on ``device``, timed on the clock."""

    @abstractmethod
    def _train_batch(self, inputs: list[tuple], hosts: list[HostMeta]) -> torch.Tensor:
        """The step's micro-batches through the engine: the loss DeepSpeed reports."""

    @abstractmethod
    def write_model(self, root: str) -> None:
        """The trained model under ``root`` (``save.save_model``: ``hf/``, or under LoRA
        ``adapter/``, and ``hf/`` with ``--merge``; a collective: every rank calls it)."""

    @property
    @abstractmethod
    def dp_rank(self) -> int: ...

    @property
    @abstractmethod
    def stage_id(self) -> int: ...

    @property
    @abstractmethod
    def reads_data(self) -> bool:
        """Whether this rank reads shards (a first stage); the others get a step's sizes from
        it."""

    @property
    def global_rank(self) -> int:
        return self.engine.global_rank

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def stage_layers(self) -> tuple[int, list[str], list[str], list[str]]:
        """This rank's stage, the layers it holds and those it recomputes whole and selectively
        (an entry of ``train_log.pipeline_record``)."""
        names, modes = self.net.stage_layer_names, self.net.recompute
        return (self.stage_id, names, [n for n, m in zip(names, modes) if m == "full"],
                [n for n, m in zip(names, modes) if m == "selective"])

    def step(self, inputs: list[tuple], hosts: list[HostMeta], global_tokens: int
             ) -> StepResult:
        """One optimizer step over this rank's ``inputs`` (``pipeline.pipeline_inputs``; none
        off the first stage) with the micro-batches' sizes ``hosts`` and the step's supervised
        tokens summed over the world. A barrier starts every rank's clock together."""
        self.loss.global_tokens = global_tokens
        torch.distributed.barrier()
        start = time.perf_counter()
        self.clock.start_step()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            allocator = allocator_calls(self.device)
        # this step's: DeepSpeed steps the schedule after the step
        lr = self.lr_at(self.engine.lr_scheduler.last_epoch)
        with HostSyncs(self.cfg.count_host_syncs) as syncs:
            value = self._train_batch(inputs, hosts)
        value = float(value)
        times = self.clock.take()  # synchronises: the step ends when the device is done with it
        seconds = time.perf_counter() - start
        extra = {}
        if self.cuda:
            extra["peak_memory_bytes"] = torch.cuda.max_memory_allocated(self.device)
            extra["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(self.device)
            # what the device holds beyond the allocator's segments: the CUDA context, kernel
            # modules, NCCL (the memory model's CUDA_CONTEXT_BYTES and NCCL_BUFFER_BYTES)
            free, total = torch.cuda.mem_get_info(self.device)
            extra["outside_allocator_bytes"] = (total - free
                                                - torch.cuda.memory_reserved(self.device))
            extra["allocator_calls"] = {name: n - allocator[name] for name, n in
                                        allocator_calls(self.device).items()}
        if self.cfg.compile_blocks:
            extra["compilations"] = COMPILES.total
        if syncs.enabled:
            extra["host_syncs"] = syncs.count
            extra["host_sync_sites"] = dict(syncs.sites.most_common())
        if self.gathered is not None and (peak := self.gathered.take()) is not None:
            extra["zero3_gathered_peak_bytes"] = peak
        if self._held:
            extra["engine_bytes"] = dict(self._held)
            self._held.clear()
        return StepResult(value, lr, times, seconds, extra)

    def save(self, folder: str, step: int) -> None:
        """A DeepSpeed checkpoint after ``step`` steps in ``folder/step-N``, with the model as
        ``write_model`` writes it (a collective)."""
        tag = f"step-{step}"
        self.engine.save_checkpoint(folder, tag=tag, client_state={
            "step": step, "parameters": self._trained_names})
        self.write_model(os.path.join(folder, tag))

    def load(self, folder: str) -> int:
        """Weights, optimizer and schedule from ``folder``'s latest checkpoint; the steps it had
        made."""
        with torch.no_grad():  # it broadcasts the tied weights again, as ``_module`` says
            _, state = self.engine.load_checkpoint(folder)
        if state is None:
            raise FileNotFoundError(f"{folder}: no checkpoint to resume from")
        return state["step"]


class PipelineEngine(TrainEngine):
    """DeepSpeed's ``PipelineEngine`` over ``VLMPipeline``: any number of stages, ZeRO-1."""

    def __init__(self, cfg: TrainConfig, model: ModelLayers, *args, **kwargs) -> None:
        super().__init__(cfg, model, *args, **kwargs)
        first, last = self.net.layer_indices[0], self.net.layer_indices[-1]
        skip_frozen_gradients(self.engine, model.input_needs_grad(first),
                              model.input_needs_grad(last + 1))

    def _module(self, model, chosen, device, topology) -> VLMPipeline:
        # Without autograd: the module broadcasts its tied weights as it builds them, and a
        # collective recorded in the graph warns at every backward that it has no gradient
        with torch.no_grad(), prints_logged(log):
            return VLMPipeline(model, self.cfg.pp, self.loss, clock=self.clock,
                               backend=model.backend, dtype=self.cfg.dtype, device=device,
                               bounds=chosen.bounds, recompute=set(chosen.recompute),
                               selective=set(chosen.selective), topology=topology)

    def _train_batch(self, inputs, hosts) -> torch.Tensor:
        self.net.expect(hosts)
        return self.engine.train_batch(iter(inputs or [no_inputs()
                                                        for _ in range(self.micro_batches)]))

    def write_model(self, root: str) -> None:
        save_hf(self.net, self.engine, root, self.cfg.merge)

    @property
    def dp_rank(self) -> int:
        return self.engine.grid.get_data_parallel_id()

    @property
    def stage_id(self) -> int:
        return self.engine.stage_id

    @property
    def reads_data(self) -> bool:
        return self.engine.is_first_stage()


class DataParallelEngine(TrainEngine):
    """DeepSpeed's plain engine over ``VLMModel``: one stage, ZeRO-2 or ZeRO-3."""

    def __init__(self, cfg: TrainConfig, *args, **kwargs) -> None:
        super().__init__(cfg, *args, **kwargs)
        if cfg.zero == 3:
            zero3_linear_bias_out_of_place()
            # what DeepSpeed split, and what it keeps whole on every rank
            kept = [int(p.ds_numel) for p in self.net.parameters()
                    if getattr(p, "ds_persist", False)]
            numel = sum(int(p.ds_numel) for p in self.net.parameters())
            log.info("ZeRO-3: %d weights of %d elements stay gathered on every rank "
                     "(--zero3-persistence-threshold); the other %.1f%% of the elements are "
                     "split over the ranks and gathered around each use", len(kept), sum(kept),
                     100 * (1 - sum(kept) / numel))
            self.gathered = GatheredWeights(self.net)

    def _module(self, model, chosen, device, topology) -> VLMModel:
        net = VLMModel(model, self.loss, device=device, dtype=self.cfg.dtype,
                       recompute=set(chosen.recompute), selective=set(chosen.selective),
                       clock=self.clock, topology=topology)
        if self.cfg.zero == 3:
            net.register_external_weights()
        return net

    def _train_batch(self, inputs, hosts) -> torch.Tensor:
        return train_batch(self.engine, self.clock, inputs, hosts)

    def write_model(self, root: str) -> None:
        save_hf_data_parallel(self.net, self.cfg.zero, root, self.cfg.merge)

    @property
    def dp_rank(self) -> int:
        return self.engine.global_rank

    @property
    def stage_id(self) -> int:
        return 0

    @property
    def reads_data(self) -> bool:
        return True


def build_engine(cfg: TrainConfig, model: ModelLayers, chosen: ChosenPartition, *,
                 device: torch.device, topology: Topology, micro_batches: int, steps: int
                 ) -> TrainEngine:
    """The engine ``cfg.zero`` takes: the pipeline engine at ZeRO-1, the plain one at 2 and 3
    (``TrainConfig`` has checked these run at one stage)."""
    fewer_host_syncs()
    clip_over_every_stage()
    engine = PipelineEngine if cfg.zero == 1 else DataParallelEngine
    return engine(cfg, model, chosen, device=device, topology=topology,
                  micro_batches=micro_batches, steps=steps)
