"""torch's ``varlen_attn`` as each supported release defines it, and the supported range.

``packed_varlen`` is run on CPU against stand-ins with the exact signatures of torch 2.10
(``is_causal``, no ``window_size`` or ``enable_gqa``: its published docs), 2.11 (``window_size``,
no ``enable_gqa``: measured on a GPU node) and 2.13 (both: read from the installed release);
each stand-in records what it is given and returns a tensor of the query's shape."""

from __future__ import annotations

import importlib.metadata
import logging

import pytest
import torch

from vlmshard.compat import check_torch, check_transformers
from vlmshard.errors import ConfigError
from vlmshard.train.attention import Spans, packed_varlen, varlen_parameters

calls: list[dict] = []


def _record(args: dict) -> torch.Tensor:
    calls.append(args)
    q, k = args["query"], args["key"]
    if q.shape[1] != k.shape[1] and not args.get("enable_gqa"):
        raise RuntimeError("the kernel needs as many K/V heads as query heads")
    return torch.zeros_like(q)  # [tokens, heads, d]


def varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
                return_aux=None, scale=None):
    return _record(locals())


def varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                scale=None, window_size=(-1, -1)):
    return _record(locals())


def varlen_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                scale=None, window_size=(-1, -1), enable_gqa=False, seqused_k=None,
                block_table=None, num_splits=None):
    return _record(locals())


KERNELS = {"2.10": varlen_2_10, "2.11": varlen_2_11, "2.13": varlen_2_13}
LENGTHS = [4, 2]  # cu_seqlens [0, 4, 6], longest 4


class Module(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2  # what transformers' SDPA path repeats K/V by


def attend(monkeypatch, release, heads_kv=2, **kwargs):
    """packed_varlen on 4 query heads over LENGTHS with ``release``'s kernel: its output and
    the K it was given, shaped as the kernel takes it ([tokens, heads, d])."""
    import torch.nn.attention.varlen

    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", KERNELS[release])
    calls.clear()
    torch.manual_seed(0)
    n = sum(LENGTHS)
    q = torch.randn(1, 4, n, 8)
    k, v = torch.randn(1, heads_kv, n, 8), torch.randn(1, heads_kv, n, 8)
    spans = Spans.from_lengths(LENGTHS, "varlen", torch.device("cpu"))
    out, _ = packed_varlen(Module(), q, k, v, None, scaling=0.5, **kwargs, **spans.kwargs())
    return out, k[0].transpose(0, 1)


def test_the_installed_release_has_the_213_parameters():
    from torch.nn.attention.varlen import varlen_attn

    if not torch.__version__.startswith("2.13."):
        pytest.skip(f"torch {torch.__version__} is installed, not 2.13")
    assert varlen_parameters(varlen_attn) == varlen_parameters(varlen_2_13)


@pytest.mark.parametrize("release, causal_form, repeated", [
    ("2.10", {"is_causal": True}, True),
    ("2.11", {"window_size": (-1, 0)}, True),
    ("2.13", {"window_size": (-1, 0), "enable_gqa": True}, False),
])
def test_causal_grouped_query_call(monkeypatch, release, causal_form, repeated):
    out, k = attend(monkeypatch, release)
    (call,) = calls
    assert out.shape == (1, 6, 4, 8)
    assert call["cu_seq_q"].tolist() == [0, 4, 6] and call["cu_seq_k"].tolist() == [0, 4, 6]
    assert call["max_q"] == 4 and call["max_k"] == 4
    assert call["scale"] == 0.5
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


def test_sliding_window_without_window_size_runs_on_sdpa(monkeypatch):
    """2.10's kernel takes no window: each sample alone on SDPA, against a mask written out by
    hand (causal, key > query - 3)."""
    out, _ = attend(monkeypatch, "2.10", sliding_window=3)
    assert calls == []
    torch.manual_seed(0)  # the same tensors attend() made
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    expected, start = [], 0
    for length in LENGTHS:
        mask = torch.tensor([[j <= i and j > i - 3 for j in range(length)]
                             for i in range(length)])
        part = slice(start, start + length)
        expected.append(torch.nn.functional.scaled_dot_product_attention(
            q[:, :, part], k[:, :, part].repeat_interleave(2, 1),
            v[:, :, part].repeat_interleave(2, 1), attn_mask=mask, scale=0.5).transpose(1, 2))
        start += length
    torch.testing.assert_close(out, torch.cat(expected, dim=1))


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
