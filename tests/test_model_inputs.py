"""The shards in a plain ``transformers`` forward: with ``model_inputs``, each packed sample's
logits and loss equal the HF model's own on that sample alone (``hf_reference.split_samples``),
under SDPA and eager attention, for InternVL (1-D position ids), Qwen2-VL (3-D mRoPE ids,
which ``transformers``' own packing detection misses) and Gemma 3 (images attended both ways,
sliding-window layers: a mask per layer kind)."""

from __future__ import annotations

import pytest
import torch
from hf_reference import make_folder, make_shards, split_samples, supervised, with_token_types
from transformers import AutoModelForImageTextToText

from vlmshard.errors import ConfigError
from vlmshard.shards.loader import ShardDataset
from vlmshard.shards.model_inputs import model_inputs

# (tokens per tile, pixel rows per tile)
UNITS = {"internvl": (256, 1), "qwen2_vl": (1, 4), "gemma3": (4, 1)}


@pytest.fixture(scope="module", params=sorted(UNITS))
def packed(request, tmp_path_factory):
    """(family, folder, shards, the micro-batch with the most samples)."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    folder = make_folder(family, str(root / "model"))
    shards = make_shards(folder, root, micro_batches=1)
    batch = max(ShardDataset(shards, pad_to_caps=False), key=lambda b: b["num_samples"])
    assert batch["num_samples"] >= 3
    return family, folder, shards, batch


def _model(folder: str, implementation: str):
    return AutoModelForImageTextToText.from_pretrained(
        folder, dtype=torch.float32, attn_implementation=implementation).eval()


def _alone(model, family: str, batch: dict) -> list[dict]:
    return with_token_types(model, split_samples(batch, model.config.image_token_id,
                                                 *UNITS[family]))


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_packed_logits_and_loss_equal_each_sample_alone(packed, implementation):
    family, folder, _, batch = packed
    model = _model(folder, implementation)
    samples = _alone(model, family, batch)
    count = sum(supervised(s) for s in samples)
    with torch.no_grad():
        out = model(**model_inputs(batch, model, num_items_in_batch=count))
        want = [model(**s, use_cache=False) for s in samples]
    logits = torch.cat([w.logits[0] for w in want])
    assert float((out.logits[0] - logits).abs().max()) <= 1e-4
    summed = sum(float(w.loss) * supervised(s) for w, s in zip(want, samples))
    assert float(out.loss) == pytest.approx(summed / count, rel=1e-5)


def test_padding_to_the_caps_changes_nothing(packed):
    family, folder, shards, batch = packed
    padded = next(b for b in ShardDataset(shards) if b["step"] == batch["step"]
                  and b["micro"] == batch["micro"])
    assert padded["input_ids"].shape[0] > batch["num_tokens"]
    model = _model(folder, "sdpa")
    with torch.no_grad():
        want = model(**model_inputs(batch, model)).logits[0]
        got = model(**model_inputs(padded, model)).logits[0, :batch["num_tokens"]]
    assert float((got - want).abs().max()) <= 1e-4


def test_flash_gets_the_boundaries_and_other_kernels_are_refused(packed):
    family, folder, _, batch = packed
    if family == "gemma3":
        pytest.skip("refused for Gemma 3 (test_models_that_packing_breaks_are_refused)")
    model = _model(folder, "sdpa")
    lengths = [s["input_ids"].shape[1] for s in _alone(model, family, batch)]
    for config in (model.config, model.config.get_text_config()):
        config._attn_implementation = "flash_attention_2"
    inputs = model_inputs(batch, model)
    assert "attention_mask" not in inputs
    assert inputs["cu_seq_lens_q"].tolist() == [sum(lengths[:k]) for k in range(len(lengths) + 1)]
    assert inputs["max_length_q"] == inputs["max_length_k"] == max(lengths)
    for config in (model.config, model.config.get_text_config()):
        config._attn_implementation = "flex_attention"
    with pytest.raises(ConfigError, match="cannot keep packed samples apart"):
        model_inputs(batch, model)


def test_split_batch_gives_each_sample_as_the_reference_cuts_it(packed):
    from vlmshard.shards.model_inputs import split_batch

    family, folder, _, batch = packed
    image_token_id = _model(folder, "sdpa").config.image_token_id
    want = split_samples(batch, image_token_id, *UNITS[family])
    got = split_batch(batch)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g["input_ids"], w["input_ids"])
        assert torch.equal(g["labels"], w["labels"])
        for key in ("pixel_values", "image_grid_thw"):
            assert (key in g) == (key in w) and (key not in g or torch.equal(g[key], w[key]))


def test_padded_loss_equals_each_sample_alone(packed):
    """``padded_inputs``: the micro-batch's samples padded per sample in one batch (the
    ``gpu_bench.py --baseline`` peer) lose what each sample alone loses, summed over them, and
    what the packed batch loses."""
    from vlmshard.shards.model_inputs import padded_inputs, split_batch

    family, folder, _, batch = packed
    model = _model(folder, "sdpa")
    samples = _alone(model, family, batch)
    count = sum(supervised(s) for s in samples)
    with torch.no_grad():
        got = model(**padded_inputs(split_batch(batch, model), model, num_items_in_batch=count))
        want = [model(**s, use_cache=False) for s in samples]
    summed = sum(float(w.loss) * supervised(s) for w, s in zip(want, samples))
    assert float(got.loss) == pytest.approx(summed / count, rel=1e-5)


def test_models_that_packing_breaks_are_refused(tmp_path):
    """Qwen3.5's linear-attention layers carry their state across packed samples in
    transformers' own forward, and flash-attn cannot attend Gemma 3's images both ways: one
    line each, rather than a silent leak."""
    for family, implementation, message in (
            ("qwen3_5", "sdpa", "linear-attention layers' state"),
            ("gemma3", "flash_attention_2", "attends to each image both ways")):
        root = tmp_path / family
        folder = make_folder(family, str(root / "model"))
        shards = make_shards(folder, root, micro_batches=1)
        batch = next(iter(ShardDataset(shards, pad_to_caps=False)))
        model = _model(folder, "sdpa")
        for config in (model.config, model.config.get_text_config()):
            config._attn_implementation = implementation
        with pytest.raises(ConfigError, match=message):
            model_inputs(batch, model)
