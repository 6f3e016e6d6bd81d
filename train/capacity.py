"""What one GPU holds before any profile: the largest micro-batch the memory model lets one bf16
stage keep, for sizing plans to a device (``benchmarks/gpu_bench.py`` packs both its plans by
it).

A micro-batch is measured in the shape of the stats' mean sample (tiles and tokens scaled
together), with the kernels the trainer runs on a GPU by default. Two bounds: recomputing
layers whole where a stage must, and selectively at most (no matmul runs twice, which MFU does
not count). Each also says how many samples a random micro-batch may take: that many of the
largest sample (the padded caps of ``packing.algorithms.padded_caps``) must fit, for any draw
of samples must.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlmshard.model_sizes import CostTerms, bytes_per_param
from vlmshard.packing.algorithms import padded_caps
from vlmshard.packing.stats import Lengths, load_stats
from vlmshard.partition import Machine, largest_micro_batch

from .config import TrainConfig
from .hf_model import rank_model


@dataclass(frozen=True)
class Bound:
    """The largest micro-batch (``max_qv`` tiles, ``max_qt`` tokens) and the most samples a
    padded random micro-batch may take inside it (at least one)."""
    max_qv: int
    max_qt: int
    samples: int


@dataclass(frozen=True)
class Capacity:
    """A device's two bounds: recomputing layers whole where it must (``whole``), and
    selectively only (``recompute_free``)."""
    whole: Bound
    recompute_free: Bound


def device_capacity(model: str, stats: str, device_bytes: int) -> Capacity:
    """The bounds of one bf16 stage of the model folder ``model`` on a device of
    ``device_bytes``, in the shape of the mean sample of the preprocess output ``stats``."""
    lengths = load_stats(stats).lengths
    shape = CostTerms(float(lengths.tiles.mean()), float(lengths.tokens.mean()))
    cfg = TrainConfig(shards=stats, out="", model=model)
    cfg.resolve_device_defaults(cuda=True)
    work = rank_model(cfg, "cuda", sequence_parallel=False).analytic_work()
    machine, per_param = Machine.for_device(device_bytes), bytes_per_param("bf16", 1)
    whole = largest_micro_batch(work, shape, machine, per_param)
    free = largest_micro_batch(work, shape, machine, per_param, whole_recompute=False)
    return Capacity(_bound(whole, lengths), _bound(free, lengths))


def _bound(size: CostTerms, lengths: Lengths) -> Bound:
    samples = 1
    while (caps := padded_caps(lengths, samples + 1)).qv <= size.tiles and \
            caps.qt <= size.tokens:
        samples += 1
    return Bound(int(size.tiles), int(size.tokens), samples)
