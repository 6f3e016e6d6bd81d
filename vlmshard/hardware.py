"""The accelerators vlmshard knows: dense bf16 peak, memory, the link between pipeline stages and
the link sequence-parallel ranks exchange over.

One table for the simulator (``vlmshard simulate --gpu``), the trainer's analytic partition (a
rank's device, by the name CUDA reports) and a benchmark's MFU. Peaks are the vendors' dense
(no sparsity) bf16 tensor-core figures.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2 ** 30


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float  # dense bf16
    memory_bytes: int
    link_bytes_per_s: float  # between pipeline stages (typically across nodes)
    # between the ranks of a sequence-parallel group, one direction (NVLink inside a node;
    # PCIe cards over PCIe)
    sp_link_bytes_per_s: float


GPUS = {
    "a100": GPU("A100-SXM4-80GB", 312e12, 80 * GIB, 25e9, 300e9),  # 200 Gb/s InfiniBand per GPU
    "h100": GPU("H100-SXM5-80GB", 989e12, 80 * GIB, 50e9, 450e9),  # 400 Gb/s InfiniBand per GPU
    "h100-pcie": GPU("H100-PCIe-80GB", 756e12, 80 * GIB, 50e9, 64e9),
    "h200": GPU("H200-SXM-141GB", 989e12, 141 * GIB, 50e9, 450e9),
    "b200": GPU("B200-180GB", 2250e12, 180 * GIB, 50e9, 900e9),
    "l40s": GPU("L40S-48GB", 362e12, 48 * GIB, 25e9, 32e9),
}

# The share of the peak a training step is assumed to sustain where nothing was measured (the
# simulator's default --mfu; the partition search needs it only to weigh compute against the
# link between stages).
SUSTAINED_SHARE = 0.45

# The card a cost model in FLOPs prices communication on: its peak FLOPs per byte its
# sequence-parallel link moves (``packing.cost.CostModel.c_sp``).
REFERENCE_GPU = "h100"


def flops_per_sp_byte(gpu: GPU) -> float:
    """How many FLOPs of compute take as long as one byte of sequence-parallel exchange."""
    return gpu.peak_flops / gpu.sp_link_bytes_per_s


def gpu_named(device_name: str) -> GPU | None:
    """The table's entry for a name as ``torch.cuda.get_device_name`` reports it (``NVIDIA
    H100 80GB HBM3``, ``NVIDIA A100-SXM4-80GB``, ``NVIDIA H100 PCIe``), or None."""
    name = device_name.upper()
    for key in ("H200", "B200", "L40S", "A100"):
        if key in name:
            return GPUS[key.lower()]
    if "H100" in name:
        return GPUS["h100-pcie" if "PCIE" in name else "h100"]
    return None
