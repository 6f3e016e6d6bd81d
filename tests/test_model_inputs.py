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
from vlmshard.shards.model_inputs import TORCH_VARLEN, model_inputs
from vlmshard.train.attention import attend_with_torch_varlen

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


def _model(folder: str, implementation: str, dtype: torch.dtype = torch.float32):
    if implementation == TORCH_VARLEN:
        model = _model(folder, "sdpa", dtype)
        attend_with_torch_varlen(model)
        return model
    return AutoModelForImageTextToText.from_pretrained(
        folder, dtype=dtype, attn_implementation=implementation).eval()


def _alone(model, family: str, batch: dict) -> list[dict]:
    return with_token_types(model, split_samples(batch, model.config.image_token_id,
                                                 *UNITS[family]))


@pytest.mark.parametrize("implementation", ["sdpa", "eager", TORCH_VARLEN])
def test_packed_logits_and_loss_equal_each_sample_alone(packed, implementation):
    """Under ``TORCH_VARLEN`` on this CPU each sample goes to SDPA alone (the ViT's images too:
    ``transformers`` hands it the boundaries in one call, as it does flash-attn)."""
    family, folder, _, batch = packed
    if family == "gemma3" and implementation == TORCH_VARLEN:
        pytest.skip("refused for Gemma 3 (test_models_that_packing_breaks_are_refused)")
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


@pytest.mark.parametrize("family", ["internvl", "qwen2_vl"])
def test_torch_varlen_on_cuda_equals_each_sample_alone(family, tmp_path):
    """``TORCH_VARLEN`` on a GPU as the Hugging Face ``Trainer`` peer trains (fp32 weights,
    bf16 autocast): torch's varlen kernel over the whole micro-batch, in the LLM and (Qwen2-VL)
    the ViT, against the same model on each sample alone with SDPA: the logits' largest error
    against each sample alone in fp32 at most twice SDPA's in bf16 (flash-attention's own
    tests' bound; a fixed 0.05 failed on 3 of 144,780 logits, 0.069 off on an H200), the loss
    within 1%."""
    from vlmshard.train.attention import available_backends

    if not torch.cuda.is_available() or "varlen" not in available_backends("cuda",
                                                                            torch.bfloat16):
        pytest.skip("needs CUDA and torch's varlen attention")
    folder = make_folder(family, str(tmp_path / "model"))
    shards = make_shards(folder, tmp_path, micro_batches=1)
    batch = max(ShardDataset(shards, pad_to_caps=False), key=lambda b: b["num_samples"])
    models = {name: _model(folder, name).cuda() for name in (TORCH_VARLEN, "sdpa")}
    samples = _alone(models["sdpa"], family, batch)
    count = sum(supervised(s) for s in samples)
    samples = [{k: v.cuda() if torch.is_tensor(v) else v for k, v in s.items()}
               for s in samples]
    with torch.no_grad():
        reference = torch.cat([models["sdpa"](**s, use_cache=False).logits[0] for s in samples])
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = models[TORCH_VARLEN](**model_inputs(batch, models[TORCH_VARLEN],
                                                      num_items_in_batch=count))
            want = [models["sdpa"](**s, use_cache=False) for s in samples]
    logits = torch.cat([w.logits[0] for w in want]).float()
    error = float((out.logits[0].float() - reference).abs().max())
    bound = 2 * float((logits - reference).abs().max())
    assert 0 < error <= bound, (error, bound)
    summed = sum(float(w.loss) * supervised(s) for w, s in zip(want, samples))
    assert float(out.loss) == pytest.approx(summed / count, rel=1e-2)


def _widest_square(model, inputs: dict) -> int:
    """The largest n of any [..., n, n] tensor an op takes or makes in ``model``'s forward on
    ``inputs`` (an attention mask or score matrix over n tokens)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Squares(TorchDispatchMode):
        widest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves((args, kwargs, out)):
                if torch.is_tensor(t) and t.dim() >= 2 and t.shape[-1] == t.shape[-2]:
                    Squares.widest = max(Squares.widest, t.shape[-1])
            return out

    with torch.no_grad(), Squares():
        model(**inputs)
    return Squares.widest


def test_the_packed_peer_makes_no_mask_over_the_micro_batch(packed):
    """The Hugging Face peer packed as ``gpu_bench.py --baseline hf_packed`` runs it
    (``TORCH_VARLEN``) attends sample by sample: no op makes a [tokens, tokens] tensor over the
    micro-batch, where SDPA on the same packed inputs takes its block mask."""
    family, folder, _, batch = packed
    if family == "gemma3":
        pytest.skip("refused for Gemma 3 (test_models_that_packing_breaks_are_refused)")
    tokens = batch["num_tokens"]
    longest = max(s["input_ids"].shape[1] for s in _alone(_model(folder, "sdpa"), family, batch))
    assert longest < tokens
    varlen = _model(folder, TORCH_VARLEN)
    assert _widest_square(varlen, model_inputs(batch, varlen)) < tokens
    sdpa = _model(folder, "sdpa")
    assert _widest_square(sdpa, model_inputs(batch, sdpa)) == tokens


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


@pytest.mark.parametrize("parts", [2, 3])
def test_a_split_micro_batch_loses_what_the_whole_loses(packed, parts):
    """``split_micro_batch`` (the packed peer's micro-batches where a whole one does not fit):
    consecutive samples, none empty, whose tokens, pixel rows and media concatenate to the
    whole's, each read by ``model_inputs`` as a micro-batch of its own, and whose losses summed
    over the whole's supervised count (the Trainer's gradient accumulation) are the whole's
    loss; each sample's own loss alone (``split_samples``) is the reference."""
    from vlmshard.shards.model_inputs import split_micro_batch

    family, folder, _, batch = packed
    model = _model(folder, "sdpa")
    split = split_micro_batch(batch, parts)
    assert len(split) == parts and all(p["num_samples"] >= 1 for p in split)
    for key in ("input_ids", "labels", "pixel_values", "sample_ids", "media_tiles"):
        assert torch.equal(torch.cat([p[key] for p in split]), batch[key]), key
    assert [s["input_ids"].shape[1] for p in split for s in _alone(model, family, p)] == \
        [s["input_ids"].shape[1] for s in _alone(model, family, batch)]
    samples = _alone(model, family, batch)
    count = sum(supervised(s) for s in samples)
    with torch.no_grad():
        got = sum(float(model(**model_inputs(p, model, num_items_in_batch=count)).loss)
                  for p in split)
        want = [model(**s, use_cache=False) for s in samples]
    summed = sum(float(w.loss) * supervised(s) for w, s in zip(want, samples))
    assert got == pytest.approx(summed / count, rel=1e-5)


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


class _InOrder:
    """A random source whose shuffle leaves the order as it is (a hand count's)."""

    def shuffle(self, items: list) -> None:
        pass


def _padded_peer():
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
    import hf_trainer

    return hf_trainer


def test_the_padded_peer_deals_each_sample_where_padding_grows_least():
    """``padded_deal`` by hand: 10 opens micro-batch 0; each 2 costs 2·10 there against 1·2,
    2·2, 3·2 beside the others; 9 costs 2·10 = 20 in micro-batch 0 against 4·9 = 36; 1 costs
    3·10 against 4·2."""
    deal = _padded_peer().padded_deal
    assert deal([10, 2, 2, 2, 9, 1], 2, _InOrder()) == [[0, 4], [1, 2, 3, 5]]
    assert deal([3, 3], 3, _InOrder()) == [[0], [1], []]


def test_the_padded_peer_takes_the_fewest_micro_batches_that_fit():
    """``fewest_parts``: every padded micro-batch of every step within the budget at the count
    it returns, some over it at one fewer; a sample over the budget on its own: each alone."""
    import random

    peer = _padded_peer()
    rng = random.Random(1)
    steps = [[rng.randint(1, 300) for _ in range(rng.randint(8, 20))] for _ in range(5)]

    def widest(parts: int) -> int:
        replay = random.Random(7)
        return max(len(p) * max((s[i] for i in p), default=0)
                   for s in steps for p in peer.padded_deal(s, parts, replay))

    parts = peer.fewest_parts(steps, 2, 1000, seed=7)
    assert parts > 2 and widest(parts) <= 1000 < widest(parts - 1)
    assert peer.fewest_parts(steps, 2, 10_000, seed=7) == 2
    # over the budget alone: as many as the step with fewest samples has, none left empty
    assert peer.fewest_parts([[5, 2000, 7, 1], [3, 4, 5]], 2, 1000, seed=7) == 3


def test_the_padded_peer_trains_each_step_on_its_samples_as_dealt(packed):
    """``PaddedBatches`` (a budget of twice the longest sample): the micro-batches a step are
    ``fewest_parts`` of the steps' sample lengths as the model's own split gives them (so the
    pixel-free scan read the same samples in the same order); each step comes as that many
    micro-batches, none empty, together exactly the packed step's samples, each padded as
    ``padded_deal`` dealt them."""
    import random

    from vlmshard.shards.model_inputs import split_batch

    family, folder, shards, _ = packed
    hf_trainer = _padded_peer()
    model = _model(folder, "sdpa")
    data = ShardDataset(shards, pad_to_caps=False)
    packed_mbs, per_step = list(data), data.micro_batches_per_step
    samples = [[s for b in packed_mbs[k:k + per_step] for s in split_batch(b, model)]
               for k in range(0, len(packed_mbs), per_step)]
    lengths = [[s["input_ids"].shape[1] for s in step] for step in samples]
    longest = max(map(max, lengths))
    peer = hf_trainer.PaddedBatches(shards, model, 0, 1, max_tokens=2 * longest)
    parts = peer.micro_batches_per_step
    assert parts == hf_trainer.fewest_parts(lengths, per_step, 2 * longest, seed=0)
    got = list(peer)
    assert len(got) == len(peer) == len(samples) * parts
    rng = random.Random(0)
    for k, step in enumerate(samples):
        dealt = hf_trainer.padded_deal(lengths[k], parts, rng)
        batches = got[k * parts:(k + 1) * parts]
        assert [tuple(b["input_ids"].shape) for b in batches] == [
            (len(d), max(lengths[k][i] for i in d)) for d in dealt]
        have = sorted(row[mask].tolist() for b in batches
                      for row, mask in zip(b["input_ids"], b["attention_mask"].bool()))
        assert have == sorted(s["input_ids"][0].tolist() for s in step)
