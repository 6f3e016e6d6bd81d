"""Every DeepSpeed internal vlmshard touches, in one place, checked against the installed release.

``PipelineModule`` has no public way to take stage bounds from the caller, nor to reach a stage's
layers by index: vlmshard overrides ``_partition_layers`` and reads the attributes it sets. These
are private, so a DeepSpeed release may rename them; ``check_compatible`` fails loudly, naming
the release and the tested range, before anything is built (``setup.cfg`` pins the same range).
``without_shm_allreduce`` keeps DeepSpeed's CPU backend from building an op training never uses.
``skip_frozen_gradients`` leaves out the gradient exchange and backward of stages a frozen
prefix of the model holds, and ``clip_over_every_stage`` clips fp32 gradients by the norm over
every stage, as torch's ``clip_grad_norm_`` over the whole model would. ``fewer_host_syncs``
replaces one helper of DeepSpeed's gradient-norm code with one that does the same without
making the host wait; ``zero3_linear_bias_out_of_place`` replaces ZeRO-3's
linear with one that leaves the matmul's output as it was made. ``route_logging`` and
``prints_logged`` put what DeepSpeed says on its own (a logger with a stdout handler, ``print``)
through the rank's logging, so ``-q`` quiets it.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import sys
from typing import Iterator

from torch import nn

from vlmshard.compat import release
from vlmshard.errors import JobError
from vlmshard.process import adopt_logger

# The DeepSpeed releases this adapter is tested with: [low, high).
TESTED_RANGE = ((0, 19), (0, 20))

# PipelineModule's private methods used here, with the parameters they must take.
_METHODS = {"_partition_layers": ("method",), "_set_bounds": ("start", "stop")}


class DeepSpeedCompatError(JobError):
    """The installed DeepSpeed lacks what the trainer relies on; the message says what."""


def check_compatible() -> None:
    """Raise ``DeepSpeedCompatError`` when the installed DeepSpeed is outside the tested range or
    lacks the internals below."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    low, high = TESTED_RANGE
    tested = f">={low[0]}.{low[1]},<{high[0]}.{high[1]}"
    if not low <= release(deepspeed.__version__) < high:
        raise DeepSpeedCompatError(
            f"deepspeed {deepspeed.__version__} is installed; vlmshard's pipeline adapter "
            f"(train/deepspeed_compat.py) is tested with deepspeed{tested}: install that range")
    for name, params in _METHODS.items():
        method = getattr(PipelineModule, name, None)
        if method is None or not set(params) <= set(inspect.signature(method).parameters):
            raise DeepSpeedCompatError(
                f"deepspeed {deepspeed.__version__}: PipelineModule.{name}({', '.join(params)}) "
                "is gone or changed; train/deepspeed_compat.py needs updating")


def set_stage_bounds(module, bounds: list[int]) -> None:
    """Inside ``_partition_layers``: stage s holds layers ``bounds[s]:bounds[s + 1]``."""
    module.parts = list(bounds)
    stage = module._topo.get_coord(module.global_rank).pipe
    module._set_bounds(start=bounds[stage], stop=bounds[stage + 1])


def layer_count(module) -> int:
    """Layers in the whole pipeline (every stage's)."""
    return len(module._layer_specs)


def local_layers(module) -> range:
    """The indices of the layers this stage holds."""
    return range(module._local_start, module._local_stop)


def stage_functions(module) -> list:
    """This stage's layers in order, as DeepSpeed calls them (tied ones included)."""
    return module.forward_funcs


def layer_module(module, index: int, tied_key: str | None) -> nn.Module:
    """The module of global layer ``index`` on this stage (a tied layer is held once per key)."""
    return module.tied_modules[tied_key] if tied_key else getattr(module, str(index))


def without_shm_allreduce() -> None:
    """Before ``deepspeed.init_distributed`` on CPU. DeepSpeed's torch backend JIT-builds its
    shared-memory all-reduce op there (a C++ build with ninja: 66 s and 2 CPU-minutes here, on
    the first run of each install; it fails on a host with no compiler) and maps a 69 MB
    ``/dev/shm`` segment per rank, which it never unlinks. The op serves only
    ``inference_all_reduce`` (AutoTP inference), which training never calls: marked incompatible,
    it is neither built nor mapped, and every collective runs on gloo as before."""
    import deepspeed.ops

    compatible = deepspeed.ops.__compatible_ops__
    if "deepspeed_shm_comm" not in compatible:
        raise DeepSpeedCompatError(
            f"deepspeed {deepspeed.__version__} has no deepspeed_shm_comm op to leave out; "
            "train/deepspeed_compat.py needs updating")
    compatible["deepspeed_shm_comm"] = False


# The modules that call DeepSpeed's non-finite mask of the global gradient norm (two import it
# by name)
_NORM_MASK_USERS = ("deepspeed.runtime.utils", "deepspeed.runtime.zero.stage_1_and_2",
                    "deepspeed.runtime.zero.stage3")


def mask_non_finite(input, device=None, val=-1.0):
    """DeepSpeed's ``mask_nan_or_inf_with_val_inplace``: the norm's non-finite values become -1
    (its invalid sentinel, whatever ``val``, as there), filled with a number. DeepSpeed's fills
    from a device tensor it makes from that number: a copy from the host, then a read back in
    ``masked_fill_``, two host syncs each optimizer step."""
    input.masked_fill_(input.isinf().logical_or_(input.isnan()), -1.0)


def fewer_host_syncs() -> None:
    """Put ``mask_non_finite`` in place of DeepSpeed's in each module that calls it."""
    import deepspeed.runtime.utils  # noqa: F401  (the modules below import it)
    import deepspeed.runtime.zero.stage3  # noqa: F401
    import deepspeed.runtime.zero.stage_1_and_2  # noqa: F401

    for name in _NORM_MASK_USERS:
        module = sys.modules[name]
        if not hasattr(module, "mask_nan_or_inf_with_val_inplace"):
            raise DeepSpeedCompatError(
                f"{name} no longer has mask_nan_or_inf_with_val_inplace; "
                "train/deepspeed_compat.py needs updating")
        module.mask_nan_or_inf_with_val_inplace = mask_non_finite


def zero3_linear_bias_out_of_place() -> None:
    """After a ZeRO-3 engine is built: DeepSpeed's ``torch.nn.functional.linear`` (its
    "memory-efficient" linear, which saves the weight itself for backward and gathers it again
    there, rather than keep a gathered copy alive) with the bias added out of place. DeepSpeed's
    adds the bias in place into the matmul's output, which selective recompute keeps from the
    forward (``vlmshard.train.recompute``): the recompute added the bias a second time, and
    the gradients through a biased linear on a 3-D input (Qwen2's q/k/v; a 2-D input takes
    ``addmm``, untouched) were wrong (tests/test_groups_train.py)."""
    import torch
    from deepspeed.runtime.zero import linear

    if torch.nn.functional.linear is not linear.zero3_linear_wrap:
        return  # not DeepSpeed's (memory_efficient_linear off), or replaced already

    class OutOfPlaceBias(linear.LinearFunctionForZeroStage3):
        @staticmethod
        def forward(input, weight, bias=None):
            if input.dim() == 2 and bias is not None:
                return torch.addmm(bias, input, weight.t())
            output = input.matmul(weight.t())
            return output if bias is None else output + bias

    def zero3_linear(input, weight, bias=None):
        return OutOfPlaceBias.apply(input, weight, bias)

    torch.nn.functional.linear = zero3_linear


def skip_frozen_gradients(engine, input_needs_grad: bool, output_needs_grad: bool) -> None:
    """On a stage of DeepSpeed's ``PipelineEngine`` next to a frozen prefix of the model (layers
    that train nothing and follow none that trains): no gradient crosses that boundary. A stage
    whose input needs no gradient sends none back (its input buffer freed as DeepSpeed's send
    frees it); a stage whose output has no graph (all its layers in the prefix) receives none
    and runs no backward (its output buffer freed as DeepSpeed's backward frees it). The schedule
    stays DeepSpeed's 1F1B: only those instructions do nothing. The engine looks its
    instructions up in ``_INSTRUCTION_MAP`` through the instance, so the instance's own map
    takes precedence."""
    from deepspeed.runtime.pipe import schedule

    if not hasattr(engine, "_INSTRUCTION_MAP") or not hasattr(engine, "pipe_buffers"):
        raise DeepSpeedCompatError("deepspeed's PipelineEngine no longer dispatches through "
                                   "_INSTRUCTION_MAP over pipe_buffers; "
                                   "train/deepspeed_compat.py needs updating")

    def release_inputs(self, buffer_id):
        self.pipe_buffers["inputs"][buffer_id] = None

    def release_outputs(self, buffer_id):
        self.pipe_buffers["outputs"][buffer_id] = None
        self.pipe_buffers["output_tensors"][buffer_id] = None

    def nothing(self, buffer_id):
        pass

    skipped = {}
    if not input_needs_grad and not engine.is_first_stage():
        skipped[schedule.SendGrad] = release_inputs
    if not output_needs_grad and not engine.is_last_stage():
        skipped[schedule.BackwardPass] = release_outputs
        skipped[schedule.RecvGrad] = nothing
    if skipped:
        engine._INSTRUCTION_MAP = {**type(engine)._INSTRUCTION_MAP, **skipped}



def clip_over_every_stage() -> None:
    """DeepSpeed's fp32 gradient clipping (``deepspeed.runtime.utils.clip_grad_norm_``, as its
    engine imports it) by the norm of every stage's gradients. DeepSpeed's, written for
    Megatron's tensor slices, counts a gradient only on model-parallel rank 0 or where the weight
    is a tensor slice, and a pipeline's model-parallel group is its stages: only the first
    stage's gradients made the norm (none at all where a frozen part fills the first stage), and
    it read the device off the first gradient, which a stage that trains nothing lacks. Here, as
    torch's ``clip_grad_norm_`` over the whole model: the L2 norm of every gradient, a tied
    weight's once (DeepSpeed marks its other copies ``ds_pipe_replicated``, as its bf16
    optimizer's norm skips them), summed over the stages; each rank's gradients are already the
    data-parallel mean. The bf16 optimizer and ZeRO-2/3 clip in their own code."""
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime import engine

    if not hasattr(engine, "clip_grad_norm_"):
        raise DeepSpeedCompatError("deepspeed.runtime.engine no longer imports clip_grad_norm_; "
                                   "train/deepspeed_compat.py needs updating")

    def clip_grad_norm_(parameters, max_norm, norm_type=2, mpu=None):
        if float(norm_type) != 2.0:
            raise ValueError(f"gradient clipping takes the L2 norm, got norm_type {norm_type}")
        held = [p for p in parameters if p.grad is not None]
        squares = torch.zeros((), dtype=torch.float32,
                              device=get_accelerator().current_device_name())
        for p in held:
            if not getattr(p, "ds_pipe_replicated", False):
                squares += p.grad.detach().float().square().sum()
        if mpu is not None:
            dist.all_reduce(squares, group=mpu.get_model_parallel_group())
        norm = squares.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in held:
            p.grad.detach().mul_(coef.to(p.grad.dtype))
        return norm

    engine.clip_grad_norm_ = clip_grad_norm_


def route_logging() -> None:
    """DeepSpeed's logger, which prints on a stdout handler of its own, through this process's
    logging (``vlmshard.process.adopt_logger``)."""
    from deepspeed.utils import logger

    adopt_logger(logger.name)


@contextlib.contextmanager
def prints_logged(log: logging.Logger) -> Iterator[None]:
    """What DeepSpeed ``print``s meanwhile (``PipelineModule``'s seed and topology lines, on
    rank 0) logged at INFO on ``log`` instead: printed, it would pass ``-q`` by."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            yield
    finally:
        for line in printed.getvalue().splitlines():
            if line.strip():
                log.info("%s", line)
