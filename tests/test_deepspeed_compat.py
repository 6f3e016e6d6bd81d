"""The DeepSpeed adapter accepts the installed release and refuses, by name, one it was not
tested with or one whose pipeline internals changed."""

from __future__ import annotations

import configparser
import os

import deepspeed
import pytest
from deepspeed.pipe import PipelineModule

from vlmshard.train import deepspeed_compat
from vlmshard.train.deepspeed_compat import DeepSpeedCompatError, check_compatible

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_installed_deepspeed_is_the_tested_one():
    check_compatible()


def test_setup_pins_the_tested_range():
    setup = configparser.ConfigParser()
    setup.read(os.path.join(ROOT, "setup.cfg"))
    (low_major, low_minor), (high_major, high_minor) = deepspeed_compat.TESTED_RANGE
    pin = f"deepspeed>={low_major}.{low_minor},<{high_major}.{high_minor}"
    assert pin in setup["options"]["install_requires"].split()


def test_an_untested_release_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(deepspeed, "__version__", "0.31.2")
    with pytest.raises(DeepSpeedCompatError, match=r"deepspeed 0\.31\.2 is installed.*"
                                                   r"deepspeed>=0\.19,<0\.20"):
        check_compatible()


@pytest.mark.parametrize("change", ["removed", "renamed parameters"])
def test_changed_internals_are_refused(monkeypatch, change):
    if change == "removed":
        monkeypatch.delattr(PipelineModule, "_set_bounds")
    else:
        monkeypatch.setattr(PipelineModule, "_set_bounds", lambda self, first, last: None)
    with pytest.raises(DeepSpeedCompatError, match=r"PipelineModule\._set_bounds\(start, stop\)"):
        check_compatible()


def test_the_sync_free_norm_mask_does_what_deepspeeds_does(monkeypatch):
    """``mask_non_finite`` gives DeepSpeed's own results (its function is the reference: -1 for
    inf, -inf and nan whatever ``val``, the rest kept), and ``fewer_host_syncs`` puts it in every
    module that calls it, so the global gradient norm of a non-finite gradient is still -1."""
    import sys

    import torch
    from deepspeed.runtime import utils

    original = utils.mask_nan_or_inf_with_val_inplace
    assert original.__module__ == "deepspeed.runtime.utils"  # DeepSpeed's, not ours
    values = torch.tensor([1.5, float("inf"), -float("inf"), float("nan"), 0.0, -2.0])
    for val in (-1.0, 7.0):
        want, got = values.clone(), values.clone()
        original(want, device=want.device, val=val)
        deepspeed_compat.mask_non_finite(got, device=got.device, val=val)
        assert torch.equal(got, want), (got, want)
    for name in deepspeed_compat._NORM_MASK_USERS:  # undone after the test
        monkeypatch.setattr(sys.modules[name], "mask_nan_or_inf_with_val_inplace", original)
    deepspeed_compat.fewer_host_syncs()
    for name in deepspeed_compat._NORM_MASK_USERS:
        assert sys.modules[name].mask_nan_or_inf_with_val_inplace is \
            deepspeed_compat.mask_non_finite
    grads = [torch.ones(3), torch.tensor([float("nan"), 1.0])]
    assert utils.get_global_norm_of_tensors(grads).item() == -1.0
    assert utils.get_global_norm_of_tensors([torch.full((4,), 2.0)]).item() == 4.0


def test_a_changed_norm_mask_is_refused(monkeypatch):
    from deepspeed.runtime.zero import stage3

    monkeypatch.delattr(stage3, "mask_nan_or_inf_with_val_inplace")
    with pytest.raises(DeepSpeedCompatError, match=r"stage3 no longer has mask_nan_or_inf"):
        deepspeed_compat.fewer_host_syncs()


def test_zero3_linear_under_selective_recompute_gives_the_plain_gradients(monkeypatch):
    """A biased linear on a [batch, tokens, features] input, then an elementwise op whose
    backward reads the linear's output, recomputed selectively (``recompute.run_layer``: the
    matmul's output kept). With DeepSpeed's ZeRO-3 linear the recompute adds the bias twice and
    the gradients are off; with ``zero3_linear_bias_out_of_place`` they are plain torch's."""
    import torch
    import torch.nn.functional as F
    from deepspeed.runtime.zero import linear

    from vlmshard.train.recompute import run_layer

    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(2, 5, 8)

    def grads() -> list[torch.Tensor]:
        layer.zero_grad()
        run_layer(lambda inp: torch.tanh(layer(inp)), x, "selective").square().sum().backward()
        return [layer.weight.grad.clone(), layer.bias.grad.clone()]

    plain = grads()
    monkeypatch.setattr(F, "linear", linear.zero3_linear_wrap)  # as ZeRO-3's engine leaves it
    assert not all(torch.allclose(a, b) for a, b in zip(grads(), plain))
    deepspeed_compat.zero3_linear_bias_out_of_place()
    assert F.linear is not linear.zero3_linear_wrap
    for a, b in zip(grads(), plain):
        torch.testing.assert_close(a, b)
