"""The LM head's fused loss (``vlmshard.train.models.loss``) against the unfused one the
``transformers`` models compute (``ForCausalLMLoss``: the logits cast to fp32, cross entropy
summed), and the work it runs, counted by torch's ``FlopCounterMode``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from vlmshard.train.models.loss import LinearCrossEntropy, _scaled_

ROWS, HIDDEN, VOCAB, CHUNK = 37, 16, 50, 8  # 5 chunks, the last of 5 rows


def counted():
    """torch's FLOP counter, which counts ``addmm`` but not its in-place form, given the same
    formula for it: 2 m k n for [m, k] @ [k, n]."""
    def addmm_(self_shape, a_shape, b_shape, out_shape=None, **kwargs) -> int:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: addmm_})


def _inputs(dtype, hidden_grad=True, weight_grad=True, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(ROWS, HIDDEN, generator=gen).to(device, dtype)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen).to(device, dtype)
    targets = torch.randint(0, VOCAB, (ROWS,), generator=gen).to(device)
    return hidden.requires_grad_(hidden_grad), weight.requires_grad_(weight_grad), targets


def _grads(loss_fn, hidden, weight, targets, scale):
    hidden.grad = weight.grad = None
    loss = loss_fn(hidden, weight, targets)
    (loss * scale).backward()
    return loss.detach(), hidden.grad, weight.grad


def fused(hidden, weight, targets):
    return LinearCrossEntropy.apply(hidden, weight, targets, CHUNK, torch.is_grad_enabled())


def unfused(hidden, weight, targets):
    return F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="sum")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2**-6)])
def test_the_fused_loss_and_its_gradients_are_the_unfused_ones(dtype, tol, device="cpu"):
    """Loss, hidden and weight gradients under a loss scale of 1/3 (as ``AveTokenLoss`` gives):
    fp32 within 1e-6 of the unfused loss, bf16 within its rounding (two units in the last place
    of the largest gradient: the weight's is rounded once per chunk it sums, the unfused
    loss's once)."""
    hidden, weight, targets = _inputs(dtype, device=device)
    scale = torch.tensor(1 / 3, device=device)
    want = _grads(unfused, hidden, weight, targets, scale)
    got = _grads(fused, hidden, weight, targets, scale)
    assert got[0].dtype == torch.float32 and got[0] == pytest.approx(want[0].item(), rel=1e-6)
    for g, w in zip(got[1:], want[1:]):
        assert g.dtype == dtype
        assert (g.float() - w.float()).abs().max() <= tol * w.float().abs().max()


def test_a_low_precision_gradient_is_scaled_in_fp32():
    """The backward's scale multiplies in fp32 and rounds once, block by block (on CUDA a bf16
    tensor times an fp32 0-dim device tensor rounds the scale to bf16 first; the CPU takes a
    0-dim tensor as a scalar and would not show it)."""
    grad = torch.randn(1000, generator=torch.Generator().manual_seed(1)).bfloat16()
    scale = torch.tensor(1 / 3 + 1e-4)
    want = (grad.float() * scale).bfloat16()
    assert torch.equal(_scaled_(grad.clone(), scale, block=64), want)


def test_the_logits_matmul_runs_once_and_the_backward_multiplies_nothing():
    """FLOPs counted by torch: the forward runs the logits' matmul and both gradients' (3 × 2 ×
    rows × hidden × vocabulary), the backward no matmul. A frozen weight drops its gradient's
    matmul, a frozen input the other's; without grad mode the logits' alone runs."""
    per_matmul = 2 * ROWS * HIDDEN * VOCAB
    hidden, weight, targets = _inputs(torch.float32)
    with counted() as forward:
        loss = fused(hidden, weight, targets)
    with counted() as backward:
        loss.backward()
    assert (forward.get_total_flops(), backward.get_total_flops()) == (3 * per_matmul, 0)
    for hidden_grad, weight_grad, matmuls in ((True, False, 2), (False, True, 2),
                                              (False, False, 1)):
        hidden, weight, targets = _inputs(torch.float32, hidden_grad, weight_grad)
        with counted() as flops:
            fused(hidden, weight, targets)
        assert flops.get_total_flops() == matmuls * per_matmul
    hidden, weight, targets = _inputs(torch.float32)
    with torch.no_grad(), counted() as flops:
        fused(hidden, weight, targets)
    assert flops.get_total_flops() == per_matmul


def test_no_supervised_row_still_reaches_both_inputs():
    """A micro-batch without a supervised token: a zero loss whose zero gradients reach the
    hidden states and the weight, so every rank runs the same backward."""
    hidden, weight, targets = _inputs(torch.float32)
    loss = fused(hidden[:0], weight, targets[:0])
    loss.backward()
    assert loss.item() == 0.0
    assert hidden.grad is not None and not hidden.grad.any()
    assert weight.grad is not None and not weight.grad.any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2**-6)])
def test_on_cuda_the_fused_loss_is_the_unfused_one_and_never_waits(dtype, tol):
    """The same on a GPU, and its forward and backward make the host wait for the device not
    once (``HostSyncs``: the sync debug mode; Liger's reads the supervised count back)."""
    from vlmshard.train.clock import HostSyncs

    test_the_fused_loss_and_its_gradients_are_the_unfused_ones(dtype, tol, device="cuda")
    hidden, weight, targets = _inputs(dtype, device="cuda")
    scale = torch.tensor(1 / 3, device="cuda")
    torch.cuda.synchronize()
    with HostSyncs(True) as syncs:
        _grads(fused, hidden, weight, targets, scale)
    assert syncs.count == 0, syncs.sites
