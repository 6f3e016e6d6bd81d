"""Whether the installed torch's varlen flash kernel takes fewer key/value heads than query heads
as they are: forward and gradients of one packed causal call against the same call with the K/V
heads repeated to the query heads.

    python benchmarks/varlen_gqa_probe.py     # on a GPU: one JSON line

torch's ``varlen_attn`` names grouped-query heads (``enable_gqa``) from 2.12 on; before, the
trainer repeats K/V heads to the query heads (``vlmshard.train.attention.repeats_kv_heads``),
which costs a copy of K and V a layer and, in a layer that keeps its activations, 4 KiB a token
for Qwen3-1.7B (``model_sizes.Saves.kv_repeated``). FlashAttention-2's kernels, which torch's
varlen call runs, take grouped-query heads themselves; whether torch 2.10/2.11's wrapper passes
them through is what this measures (``takes_fewer_kv_heads``), with the largest differences
from the repeated call. With ``enable_gqa``, the call names it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def probe(lengths: list[int], heads: int, kv_heads: int, head_dim: int) -> dict:
    import torch
    from torch.nn.attention.varlen import varlen_attn

    from vlmshard.train.attention import varlen_parameters

    names = varlen_parameters(varlen_attn)
    options = {"window_size": (-1, 0)} if "window_size" in names else {"is_causal": True}
    gen = torch.Generator("cuda").manual_seed(0)
    total = sum(lengths)

    def leaf(n: int) -> torch.Tensor:
        return torch.randn(total, n, head_dim, device="cuda", dtype=torch.bfloat16,
                           generator=gen).requires_grad_()

    q, k, v = leaf(heads), leaf(kv_heads), leaf(kv_heads)
    grad = torch.randn(total, heads, head_dim, device="cuda", dtype=torch.bfloat16,
                       generator=gen)
    cu = torch.tensor([0, *lengths], device="cuda", dtype=torch.int32).cumsum(0,
                                                                           dtype=torch.int32)

    def run(as_is: bool) -> list[torch.Tensor]:
        group = heads // kv_heads
        keys, values = (k, v) if as_is else (t.repeat_interleave(group, dim=1) for t in (k, v))
        extra = {"enable_gqa": True} if as_is and "enable_gqa" in names else {}
        out = varlen_attn(q, keys, values, cu, cu, max(lengths), max(lengths), **options,
                          **extra)
        grads = torch.autograd.grad(out, (q, k, v), grad)
        return [out, *grads]

    repeated = run(as_is=False)
    result = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0),
              "enable_gqa": "enable_gqa" in names, "lengths": lengths, "heads": heads,
              "kv_heads": kv_heads, "head_dim": head_dim}
    try:  # torch's wrapper or kernel may refuse K/V heads fewer than the query's
        as_is = run(as_is=True)
    except (RuntimeError, ValueError) as e:
        return {**result, "takes_fewer_kv_heads": False, "error": str(e).splitlines()[0]}
    diffs = {name: float((a.float() - b.float()).abs().max() / b.float().abs().max())
             for name, a, b in zip(("out", "dq", "dk", "dv"), (t.detach() for t in as_is),
                                   (t.detach() for t in repeated))}
    # bf16: the gradients of a repeated head sum in another order than the kernel's
    return {**result, "takes_fewer_kv_heads": max(diffs.values()) < 2e-2,
            "relative_max_diff": diffs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[300, 517, 1024, 2048],
                   help="the packed segments' lengths")
    p.add_argument("--heads", type=int, default=16, help="query heads (Qwen3-1.7B's)")
    p.add_argument("--kv-heads", type=int, default=8, help="key/value heads (Qwen3-1.7B's)")
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        p.error("needs a CUDA device: torch's varlen kernel runs on CUDA only")
    print(json.dumps(probe(args.lengths, args.heads, args.kv_heads, args.head_dim)))


if __name__ == "__main__":
    main()
