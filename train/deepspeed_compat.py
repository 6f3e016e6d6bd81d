"""Every DeepSpeed internal vlmshard touches, in one place, checked against the installed release.

``PipelineModule`` has no public way to take stage bounds from the caller, nor to reach a stage's
layers by index: vlmshard overrides ``_partition_layers`` and reads the attributes it sets. These
are private, so a DeepSpeed release may rename them; ``check_compatible`` fails loudly, naming
the release and the tested range, before anything is built (``setup.cfg`` pins the same range).
"""

from __future__ import annotations

import inspect

from torch import nn

from vlmshard.compat import release
from vlmshard.errors import JobError

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
