"""The LM head's loss, fused (``vlmshard.train.models.loss``: each chunk's gradients computed in
the forward) against the chunked loss recomputed in backward that the trainer ran before
(each chunk's logits under ``torch.utils.checkpoint``: made in the forward, made again in
backward), side by side in one run.

    python benchmarks/loss_bench.py [--rows 512] [--hidden 2048] [--vocab 151936] [--repeats 5]
    python benchmarks/loss_bench.py --smoke

The head of Qwen3-VL-2B by default (hidden 2048, a vocabulary of 151,936), random weights and
hidden states, ``--rows`` supervised rows in chunks of ``LOSS_CHUNK``, fp32 on this machine's
CPUs (its bf16 matmuls are several times slower than its fp32 ones; a GPU runs bf16). Printed
per loss: the median seconds of a forward + backward (the two alternated each repeat), the
FLOPs torch's ``FlopCounterMode`` counts in each (the in-place ``addmm_`` given ``addmm``'s
formula), the ops dispatched, and the most bytes held at once beyond the inputs (a
``TorchDispatchMode`` tracking the live storages of every op's outputs); then the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from vlmshard.model_sizes import LOSS_CHUNK  # noqa: E402
from vlmshard.train.models.loss import LinearCrossEntropy  # noqa: E402


def fused(hidden, weight, targets):
    return LinearCrossEntropy.apply(hidden, weight, targets, LOSS_CHUNK, True)


def recomputed(hidden, weight, targets):
    """The loss as the trainer ran it until 2026-12-04: each chunk's logits, cast up, and its
    cross entropy under a checkpoint (recomputed in backward)."""
    def chunk_loss(rows, weight, target):
        return F.cross_entropy(F.linear(rows, weight).float(), target, reduction="sum")
    return torch.stack([checkpoint(chunk_loss, hidden[i:i + LOSS_CHUNK], weight,
                                   targets[i:i + LOSS_CHUNK], use_reentrant=False)
                        for i in range(0, hidden.shape[0], LOSS_CHUNK)]).sum()


LOSSES = {"fused": fused, "recomputed": recomputed}


class Held(TorchDispatchMode):
    """Ops dispatched, and the most bytes of op outputs alive at once: their storages held by
    weak references (``StorageWeakRef``: alive while any tensor, a saved one included, holds
    them), those of ``inputs`` aside (a view of an input, the weight's transpose, shares its
    storage)."""

    def __init__(self, inputs: tuple[torch.Tensor, ...]) -> None:
        super().__init__()
        self.ops, self.live, self.peak = 0, {}, 0
        self.inputs = {t.untyped_storage().data_ptr() for t in inputs}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        # freed storages first: a new one may take a freed one's address
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                storage = t.untyped_storage()
                if storage.data_ptr() in self.inputs:
                    continue
                self.live.setdefault(storage.data_ptr(),
                                     (StorageWeakRef(storage), storage.nbytes()))
        self.peak = max(self.peak, sum(nbytes for _, nbytes in self.live.values()))
        return out


def run(loss_fn, hidden, weight, targets) -> float:
    hidden.grad = weight.grad = None
    start = time.perf_counter()
    loss = loss_fn(hidden, weight, targets)
    (loss * (1 / hidden.shape[0])).backward()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=512, help="supervised rows")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="a tiny head, one repeat")
    args = p.parse_args()
    if args.smoke:
        args.rows, args.hidden, args.vocab, args.repeats = 1100, 16, 64, 1
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.rows, args.hidden, generator=gen).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) * 0.02).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.rows,), generator=gen)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.rows} rows, "
          f"hidden {args.hidden}, vocabulary {args.vocab}, chunks of {LOSS_CHUNK}, fp32")
    counts = {}
    for name, loss_fn in LOSSES.items():
        flops = FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: (
            lambda s, a, b, out_shape=None, **kw: 2 * a[0] * a[1] * b[1])})
        with flops, Held((hidden, weight, targets)) as held:
            run(loss_fn, hidden, weight, targets)
        counts[name] = (flops.get_total_flops(), held.ops, held.peak)
    times = {name: [] for name in LOSSES}
    for _ in range(args.repeats + 1):  # the first: warm-up
        for name, loss_fn in LOSSES.items():
            times[name].append(run(loss_fn, hidden, weight, targets))
    medians = {name: statistics.median(t[1:] if len(t) > 1 else t) for name, t in times.items()}
    print(f"{'loss':<11} {'median s':>9} {'GFLOP':>8} {'ops':>6} {'held MB':>8}  runs (s)")
    for name in LOSSES:
        flop, ops, peak = counts[name]
        print(f"{name:<11} {medians[name]:9.3f} {flop / 1e9:8.2f} {ops:>6} {peak / 1e6:8.1f}  "
              + ", ".join(f"{t:.3f}" for t in times[name][1:]))
    f, r = counts["fused"], counts["recomputed"]
    print(f"fused / recomputed: time {medians['fused'] / medians['recomputed']:.2f}, FLOPs "
          f"{f[0] / r[0]:.2f}, ops {f[1] / r[1]:.2f}, held {f[2] / r[2]:.2f}")


if __name__ == "__main__":
    main()
