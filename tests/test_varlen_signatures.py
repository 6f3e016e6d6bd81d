"""torch's ``varlen_attn`` as each supported release defines it, and the supported range.

``packed_varlen`` is run on CPU against stand-ins with the exact signatures of torch 2.10
(``is_causal``; no ``scale``, ``window_size`` or ``enable_gqa``), 2.11 (``scale`` and
``window_size``, no ``enable_gqa``) and 2.12/2.13 (all three), read from
``torch/nn/attention/varlen.py`` in the 2.10.0, 2.11.0 and 2.12.0 wheels on PyPI and in the
installed 2.13; each stand-in records what it is given and returns a tensor of the query's
shape. 2.10's private ops (``torch_attn::_varlen_attn`` and its backward, which a compiled
block's attention calls) are stood in for with their exact schemas too, on the reference
flash kernels (``flash_reference``)."""

from __future__ import annotations

import importlib.metadata
import logging

import pytest
import torch
from torch import Tensor

from vlmshard.compat import check_torch, check_transformers
from vlmshard.errors import ConfigError
from vlmshard.train.attention import Spans, packed_varlen, varlen_parameters

calls: list[dict] = []


def _record(args: dict) -> Tensor:
    calls.append(args)
    q, k = args["query"], args["key"]
    if q.shape[1] != k.shape[1] and not args.get("enable_gqa"):
        raise RuntimeError("the kernel needs as many K/V heads as query heads")
    return torch.zeros_like(q)  # [tokens, heads, d]


def varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
                return_aux=None):
    return _record(locals())


def varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                scale=None, window_size=(-1, -1)):
    return _record(locals())


def varlen_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                scale=None, window_size=(-1, -1), enable_gqa=False, seqused_k=None,
                block_table=None, num_splits=None):
    return _record(locals())


KERNELS = {"2.10": varlen_2_10, "2.11": varlen_2_11, "2.12": varlen_2_13,  # 2.12's is 2.13's
           "2.13": varlen_2_13}
D = 8  # head dim: the kernels' own scale is D ** -0.5
LENGTHS = [4, 2]  # cu_seqlens [0, 4, 6], longest 4


class Module(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2  # what transformers' SDPA path repeats K/V by


def attend(monkeypatch, release, heads_kv=2, scaling=D ** -0.5, **kwargs):
    """packed_varlen on 4 query heads over LENGTHS with ``release``'s kernel: its output and
    the K it was given, shaped as the kernel takes it ([tokens, heads, d])."""
    import torch.nn.attention.varlen

    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", KERNELS[release])
    calls.clear()
    torch.manual_seed(0)
    n = sum(LENGTHS)
    q = torch.randn(1, 4, n, D)
    k, v = torch.randn(1, heads_kv, n, D), torch.randn(1, heads_kv, n, D)
    spans = Spans.from_lengths(LENGTHS, "varlen", torch.device("cpu"))
    out, _ = packed_varlen(Module(), q, k, v, None, scaling=scaling, **kwargs, **spans.kwargs())
    return out, k[0].transpose(0, 1)


def test_the_installed_release_has_its_stand_ins_parameters():
    """Here 2.13's; under ``make test-torch TORCH=2.10.0`` (or 2.11.0, 2.12.0) that release's,
    and 2.10's private ops have the schemas ``op_2_10`` stands in with."""
    from torch.nn.attention.varlen import varlen_attn

    release = ".".join(torch.__version__.split(".")[:2])
    assert varlen_parameters(varlen_attn) == varlen_parameters(KERNELS[release])
    if release == "2.10":
        for name in ("_varlen_attn", "_varlen_attn_backward"):
            ours = getattr(torch.ops.vlmshard_tests_torch_2_10, name).default._schema
            theirs = getattr(torch.ops.torch_attn, name).default._schema
            assert [(a.name, str(a.type)) for a in theirs.arguments] == [
                (a.name, str(a.type)) for a in ours.arguments]


@pytest.mark.parametrize("release, causal_form, repeated", [
    ("2.10", {"is_causal": True}, True),
    ("2.11", {"window_size": (-1, 0)}, True),
    ("2.12", {"window_size": (-1, 0), "enable_gqa": True}, False),
    ("2.13", {"window_size": (-1, 0), "enable_gqa": True}, False),
])
def test_causal_grouped_query_call(monkeypatch, release, causal_form, repeated):
    out, k = attend(monkeypatch, release)
    (call,) = calls
    assert out.shape == (1, 6, 4, 8)
    assert call["cu_seq_q"].tolist() == [0, 4, 6] and call["cu_seq_k"].tolist() == [0, 4, 6]
    assert call["max_q"] == 4 and call["max_k"] == 4
    if release == "2.10":  # no scale to pass: the kernel's own is the layer's
        assert "scale" not in call
    else:
        assert call["scale"] == D ** -0.5
    for name in ("is_causal", "window_size", "enable_gqa"):
        if name in causal_form:
            assert call[name] == causal_form[name]
        elif name in call:  # the parameter exists: left at its default
            assert call[name] in (False, (-1, -1))
    if repeated:  # query heads 0, 1 read K/V head 0; heads 2, 3 read K/V head 1
        assert torch.equal(call["key"], k[:, [0, 0, 1, 1]])
    else:
        assert torch.equal(call["key"], k)
    assert call["value"].shape == call["key"].shape


@pytest.mark.parametrize("release, expected", [
    ("2.10", {"is_causal": False}), ("2.11", {"window_size": (-1, -1)}),
    ("2.13", {"window_size": (-1, -1)})])
def test_bidirectional_call(monkeypatch, release, expected):
    attend(monkeypatch, release, is_causal=False)
    (call,) = calls
    assert {name: call[name] for name in expected} == expected


def test_equal_heads_send_no_enable_gqa(monkeypatch):
    _, k = attend(monkeypatch, "2.13", heads_kv=4)
    (call,) = calls
    assert call["enable_gqa"] is False and torch.equal(call["key"], k)


@pytest.mark.parametrize("release", ["2.11", "2.13"])
def test_sliding_window_is_the_kernels_window(monkeypatch, release):
    attend(monkeypatch, release, sliding_window=3)
    (call,) = calls
    assert call["window_size"] == (2, 0)  # a query sees the 2 keys before it and itself


def sdpa_by_hand(scale: float, window: int | None = None) -> Tensor:
    """The output ``attend`` should give: each of LENGTHS alone through SDPA, causal (with a
    ``window``, key > query - window)."""
    from flash_reference import sdpa_by_segment

    torch.manual_seed(0)  # the same tensors attend() made
    n = sum(LENGTHS)
    q, k, v = torch.randn(1, 4, n, D), torch.randn(1, 2, n, D), torch.randn(1, 2, n, D)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return sdpa_by_segment(q, k, v, cu, True, window, scale)


def test_sliding_window_without_window_size_runs_on_sdpa(monkeypatch):
    """2.10's kernel takes no window: each sample alone on SDPA."""
    out, _ = attend(monkeypatch, "2.10", sliding_window=3)
    assert calls == []
    torch.testing.assert_close(out, sdpa_by_hand(D ** -0.5, window=3))


@pytest.mark.parametrize("release", ["2.10", "2.11", "2.13"])
def test_a_scale_other_than_the_kernels_own(monkeypatch, release):
    """A layer scaled by other than 1/√head_dim (Gemma 3's ``query_pre_attn_scalar``): the
    kernel is given it where it takes a scale; 2.10's takes none, so each sample runs alone on
    SDPA at the layer's scale."""
    out, _ = attend(monkeypatch, release, scaling=0.5)
    if release != "2.10":
        (call,) = calls
        assert call["scale"] == 0.5
        return
    assert calls == []
    torch.testing.assert_close(out, sdpa_by_hand(0.5))


@torch.library.custom_op("vlmshard_tests_torch_2_10::_varlen_attn", mutates_args={})
def op_2_10(query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor, cu_seq_k: Tensor,
            max_q: int, max_k: int, is_causal: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """2.10's ``torch_attn::_varlen_attn``: its schema, and the flash call its body makes."""
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, 0.0, is_causal,
        return_debug_mask=False)
    return out, lse, torch.zeros(2, dtype=torch.uint64, device=query.device)


@torch.library.custom_op("vlmshard_tests_torch_2_10::_varlen_attn_backward", mutates_args={})
def op_2_10_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor,
                     lse: Tensor, cu_seq_q: Tensor, cu_seq_k: Tensor, max_q: int, max_k: int,
                     is_causal: bool, rng_state: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """2.10's ``torch_attn::_varlen_attn_backward``, likewise."""
    return torch.ops.aten._flash_attention_backward(
        grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, 0.0,
        is_causal, rng_state, torch.empty(0, device=query.device))


@pytest.mark.parametrize("scale, kernel_calls", [
    (D ** -0.5, {"forward": 1, "backward": 1}), (0.3, {})])
def test_a_compiled_blocks_attention_on_2_10s_ops(monkeypatch, scale, kernel_calls):
    """2.10's private ops take no scale: at the kernel's own, a compiled block's attention
    (``packed_attention``) runs its forward and backward once each; at another scale, each
    sample alone on SDPA. Both within 1e-5 of SDPA on each segment."""
    import torch.nn.attention.varlen
    from flash_reference import against_sdpa

    from vlmshard.train.attention import _VarlenOps, packed_attention

    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", varlen_2_10)
    ops_2_10 = torch.ops.vlmshard_tests_torch_2_10
    monkeypatch.setattr(torch.ops, "torch_attn", ops_2_10)
    _VarlenOps.installed.cache_clear()
    try:
        assert _VarlenOps.installed().forward is ops_2_10._varlen_attn.default

        def attend(query, key, value, cu):
            return packed_attention(query, key, value, cu, cu,
                                    torch.zeros(0, 3, dtype=torch.long), "varlen", True, 2,
                                    scale, None)[0]

        assert against_sdpa(attend, True, None, scale) == kernel_calls
    finally:
        _VarlenOps.installed.cache_clear()


def test_missing_parameters_are_logged_once(monkeypatch, caplog):
    varlen_parameters.cache_clear()
    with caplog.at_level(logging.INFO, logger="vlmshard.train.attention"):
        for _ in range(2):
            attend(monkeypatch, "2.11")
    lines = [r.getMessage() for r in caplog.records]
    assert sum("no enable_gqa" in line for line in lines) == 1
    assert not any("no window_size" in line for line in lines)


@pytest.mark.parametrize("version, supported", [
    ("2.9.1", False), ("2.10.0", True), ("2.11.0+cu130", True), ("2.13.0+cpu", True),
    ("2.14.0", False)])
def test_torch_outside_the_supported_range_is_one_line(monkeypatch, version, supported):
    monkeypatch.setattr(torch, "__version__", version)
    if supported:
        check_torch()
        return
    with pytest.raises(ConfigError) as error:
        check_torch()
    message = str(error.value)
    assert "\n" not in message
    assert f"torch {version} is installed" in message and "torch>=2.10,<2.14" in message


def test_train_refuses_an_unsupported_torch_in_one_line(monkeypatch, capsys, tmp_path):
    """Before anything is read or built: the shards named here do not even exist."""
    from vlmshard.cli import main

    monkeypatch.setattr(torch, "__version__", "2.9.1")
    status = main(["train", "--shards", str(tmp_path / "none"), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and len(err) == 1
    assert err[0].startswith("vlmshard train: error: torch 2.9.1 is installed")


def installed_transformers(monkeypatch, version: str) -> None:
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: version if name == "transformers" else real(name))


@pytest.mark.parametrize("version, supported", [
    ("5.17.0", False), ("5.18.0", False), ("5.19.0", True), ("5.23.0", True), ("6.0.0", False)])
def test_transformers_outside_the_supported_range_is_one_line(monkeypatch, version, supported):
    """5.17 and 5.18 fail the tests that hold packed inputs and video positions to the model's
    own code (``test_model_inputs.py``, ``test_video.py``)."""
    installed_transformers(monkeypatch, version)
    if supported:
        check_transformers()
        return
    with pytest.raises(ConfigError) as error:
        check_transformers()
    assert str(error.value) == (f"transformers {version} is installed; vlmshard supports "
                                "transformers>=5.19,<6.0: install a release in that range")


def test_preprocess_with_a_model_refuses_an_unsupported_transformers_in_one_line(
        monkeypatch, capsys, tmp_path):
    from vlmshard.cli import main

    installed_transformers(monkeypatch, "5.17.0")
    data = tmp_path / "data.jsonl"
    data.write_text('{"conversations": [{"from": "human", "value": "hi"}, '
                    '{"from": "gpt", "value": "hello"}]}\n')
    status = main(["preprocess", str(data), "--model", str(tmp_path / "model"), "--out",
                   str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and len(err) == 1
    assert err[0].startswith("vlmshard preprocess: error: transformers 5.17.0 is installed")
