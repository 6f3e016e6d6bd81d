"""The LM head's loss: next-token cross entropy over the supervised tokens, the head's matmul
fused with it as Liger's fused linear + cross entropy is (``liger_kernel.ops.
fused_linear_cross_entropy``, read at 0.8.5): the logits are made ``LOSS_CHUNK`` rows at a time
and each chunk's gradients, to the hidden states and to the head's weight, are computed in the
forward, so the backward only scales them. The logits' matmul then runs once, not again in
backward as a recomputed chunk's would, and a chunk holds one fp32 [rows, vocab] buffer.

Unlike Liger's, the count of supervised tokens comes from the host (``Micro.host``): Liger's
reads it back from the device once a call, a wait each micro-batch. The arithmetic is the
``transformers`` loss's (``ForCausalLMLoss``): the logits cast to fp32, their log-softmax, the
gradient cast back to the run's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vlmshard.model_sizes import LOSS_CHUNK, LOSS_SCALE_BLOCK
from vlmshard.preprocess.tokenize import IGNORE_INDEX

from ..micro import Micro


def lm_loss(weight: torch.Tensor, micro: Micro, chunk: int = LOSS_CHUNK) -> torch.Tensor:
    """Next-token cross entropy summed over the supervised tokens of ``micro`` (the target of
    token t is label t + 1 of the same sample), the logits ``micro.x @ weight.T`` made for
    supervised rows only, ``chunk`` rows at a time: a [tokens, vocab] tensor would not fit."""
    targets = micro.targets()
    # the supervised rows, their count known on the host: no read back of the mask
    keep = torch.nonzero_static(targets != IGNORE_INDEX, size=micro.host.supervised).flatten()
    hidden, targets = micro.x.index_select(0, keep), targets.index_select(0, keep)
    # a micro-batch without a supervised token (a sequence-parallel share, one of prompts) still
    # returns a loss of the hidden states and the weight: its zero gradients reach both, so every
    # rank runs the same backward (``micro.HostMeta.of_batch`` says why)
    return LinearCrossEntropy.apply(hidden, weight, targets, chunk, torch.is_grad_enabled())


class LinearCrossEntropy(torch.autograd.Function):
    """``Σ cross_entropy(hidden @ weight.T, targets)``, its gradients computed in the forward.

    The hidden states' gradient is saved for backward (it is what the head keeps per supervised
    row, in place of the hidden states); the weight's is held on ``ctx`` beside it, as the
    parameter's gradient it becomes (the memory model counts it with the parameters)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk: int, grad_enabled: bool) -> torch.Tensor:
        # ``needs_input_grad`` holds under ``no_grad`` too (an evaluation): no gradients there
        need_hidden, need_weight = (grad_enabled and n for n in ctx.needs_input_grad[:2])
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        loss = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, hidden.shape[0], chunk):
            rows, target = hidden[start:start + chunk], targets[start:start + chunk]
            # log-softmax's arithmetic in place on the fp32 logits: one [rows, vocab] fp32
            # buffer, where log_softmax would make a second
            logits = F.linear(rows, weight).float()
            logits -= logits.amax(dim=-1, keepdim=True)
            picked = logits.gather(1, target[:, None])
            sums = logits.exp_().sum(dim=-1, keepdim=True)
            loss += (sums.log() - picked).sum()
            if not (need_hidden or need_weight):
                continue
            # d loss / d logits = softmax - one-hot(target), in fp32, then in the run's dtype
            grad = logits.div_(sums)
            grad[torch.arange(len(target), device=grad.device), target] -= 1
            grad = grad.to(hidden.dtype)
            del logits
            if need_hidden:
                torch.mm(grad, weight, out=grad_hidden[start:start + chunk])
            if need_weight:
                grad_weight.addmm_(grad.t(), rows)
        ctx.save_for_backward(grad_hidden)
        ctx.grad_weight = grad_weight
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        (grad_hidden,) = ctx.saved_tensors
        grad_weight, ctx.grad_weight = ctx.grad_weight, None
        return (*(_scaled_(g, grad_loss) if g is not None else None
                  for g in (grad_hidden, grad_weight)), None, None, None)


def _scaled_(grad: torch.Tensor, scale: torch.Tensor, block: int = LOSS_SCALE_BLOCK
             ) -> torch.Tensor:
    """``grad`` times the 0-dim fp32 ``scale``, in place, multiplied in fp32 as the unfused
    loss's backward scales the logits' gradient: a bf16 tensor times a device tensor would
    round the scale to bf16 first (a bias of up to 2^-9 on every gradient). ``block``: the
    elements made fp32 at a time (this runs at the step's memory peak)."""
    if grad.dtype == scale.dtype:
        return grad.mul_(scale)
    flat = grad.view(-1)
    for start in range(0, flat.numel(), block):
        part = flat[start:start + block]
        part.copy_(part.float().mul_(scale))
    return grad
