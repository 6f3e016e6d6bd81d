"""What the trainer's engine holds per parameter, trained or frozen, and what ZeRO-3 holds beyond
that: the part of a stage's memory that grows with its weights, not with its micro-batch."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .memory import ACTIVATION_BYTES, FP32


def bytes_per_param(precision: str = "bf16", dp: int = 1, grad_accum: str = "fp32",
                    zero: int = 1) -> float:
    """Device bytes per trained parameter that DeepSpeed holds for ``vlmshard train`` with
    torch's AdamW (weights, gradients, master weights, both moments): the larger of what it
    holds through backward and at the optimizer update (``deepspeed_config`` picks the
    optimizer; ``vlmshard.train.engine_memory`` counts the engine's tensors to check this).
    ``dp`` is the data-parallel degree ZeRO splits over. With ``zero=3`` the weights are split
    too: the bytes are per parameter of the whole model, not of one rank's partition; what
    ZeRO-3 holds beyond them is ``zero3_fixed_bytes``. Not included: the copies a gradient
    reduction or flattening makes for a moment.

    - fp32, ZeRO-1: the trainer configures no ZeRO in fp32, so DeepSpeed steps torch's AdamW
      itself, nothing split: weight, gradient and two moments, 16.
    - fp32, ZeRO-2: weight 4; ZeRO's fp32 gradient partition, master copy and moments 16/dp.
    - fp32, ZeRO-3: weight partition, gradient partition buffer, the update's flattened gradient,
      master copy (4/dp each) and moments (8/dp): 24/dp.
    - bf16, ZeRO-1, fp32 accumulation (DeepSpeed's BF16_Optimizer, pipeline or not): bf16
      weight and gradient 4, the whole fp32 accumulation buffer 4, fp32 master and moments
      12/dp.
    - bf16, ZeRO-1, bf16 accumulation (DeepSpeed's ZeRO-1 optimizer): bf16 weight 2, then the
      bf16 gradient through backward (2) or the fp32 gradient partition at the update (4/dp),
      master and moments 12/dp.
    - bf16, ZeRO-2: bf16 weight 2; the gradient partition (4/dp at the update, either
      accumulation), master and moments: 2 + 16/dp.
    - bf16, ZeRO-3: weight partition 2/dp, gradient partition buffer in the accumulation dtype
      (4/dp or 2/dp), the update's fp32 gradient 4/dp, master and moments 12/dp.
    """
    if precision not in ("fp32", "bf16") or grad_accum not in ("fp32", "bf16"):
        raise ConfigError(f"unknown precision {precision!r} or gradient accumulation "
                          f"{grad_accum!r} (bf16 or fp32)")
    if zero not in (1, 2, 3):
        raise ConfigError(f"ZeRO stage {zero!r}: the trainer runs 1, 2 or 3")
    accum = 4 if grad_accum == "fp32" else 2
    if precision == "fp32":
        return {1: 16.0, 2: 4 + 16 / dp, 3: 24 / dp}[zero]
    if zero == 1:
        return 8 + 12 / dp if grad_accum == "fp32" else 2 + max(2, 4 / dp) + 12 / dp
    if zero == 2:
        return 2 + 16 / dp
    return (2 + accum + 4 + 12) / dp


def weight_bytes_per_param(precision: str = "bf16", dp: int = 1, zero: int = 1) -> float:
    """Device bytes per frozen parameter: its weight alone, in the run's dtype (no gradient, no
    master copy, no moments); ZeRO-3 splits it over the ``dp`` ranks as it splits every
    weight."""
    width = ACTIVATION_BYTES if precision == "bf16" else FP32
    return width / dp if zero == 3 else float(width)


# DeepSpeed's ZeRO-3 settings the trainer leaves at their defaults (deepspeed.runtime.zero.config,
# checked against it by tests/test_model_sizes.py), in elements
ZERO3_REDUCE_BUCKET = 500_000_000  # reduce_bucket_size
ZERO3_PREFETCH_BUCKET = 50_000_000  # stage3_prefetch_bucket_size
ZERO3_MAX_REUSE_DISTANCE = 1_000_000_000  # stage3_max_reuse_distance
ZERO3_PERSISTENCE_THRESHOLD = 100_000  # stage3_param_persistence_threshold


@dataclass(frozen=True)
class Zero3Weights:
    """What ZeRO-3's fixed costs depend on, in elements of the trained weights: all of them,
    those at most the persistence threshold (kept whole on every rank), and the largest set one
    module holds itself (ZeRO-3 gathers a module's own weights together)."""

    total: int
    persistent: int
    largest_module: int


def zero3_fixed_bytes(weights: Zero3Weights, precision: str = "bf16",
                      dp: int = 1) -> dict[str, int]:
    """Bytes a ZeRO-3 rank holds beyond ``bytes_per_param`` times the parameters, which counts
    every weight split over the ``dp`` ranks, by part:

    - ``reduce_bucket``: the gradient reduce buffer, allocated whole for the run whatever the
      model's size (``engine_memory`` counts it apart, as ``buckets``);
    - ``gathered``: weights gathered whole around their use. A released module's weights stay
      gathered where the trace uses them again within the reuse distance, so at once at most
      that distance's worth, the prefetched bucket and the running module's own: at the turn
      from forward to backward, the last layers of the forward (a small model's every weight);
    - ``gradient``: the largest module's whole gradient, before the reduce bucket takes it;
    - ``persistent``: the weights under the persistence threshold, kept whole on every rank
      where ``bytes_per_param`` charged each rank its split.
    """
    width = ACTIVATION_BYTES if precision == "bf16" else FP32
    split = weights.total - weights.persistent
    gathered = min(split, ZERO3_MAX_REUSE_DISTANCE + ZERO3_PREFETCH_BUCKET
                   + weights.largest_module)
    return {"reduce_bucket": ZERO3_REDUCE_BUCKET * width, "gathered": gathered * width,
            "gradient": weights.largest_module * width,
            "persistent": int(width * weights.persistent * (1 - 1 / dp))}
