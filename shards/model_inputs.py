"""A loader micro-batch as a plain ``transformers`` model's keyword arguments, with the packed
samples kept apart, for training on the shards with your own loop or trainer::

    from vlmshard.shards.loader import make_loader
    from vlmshard.shards.model_inputs import model_inputs

    for batch in make_loader("shards/", rank, world_size):
        loss = model(**model_inputs(batch, model)).loss

What keeps the samples apart follows ``model.config._attn_implementation``: each sample's
boundaries for flash-attn's varlen kernel (or torch's, ``TORCH_VARLEN``), or a 4-D additive
mask (one per layer kind where the model's layers attend differently) for ``sdpa`` and
``eager``. Refused: any other implementation (nothing tells it where samples end), flash-attn
for a model whose images attend both ways, and a model with linear-attention layers. Position
ids restart at each sample, and labels are shifted here, never across a sample boundary.
``split_batch`` gives each sample alone; ``padded_inputs`` gives them as one right-padded batch;
``split_micro_batch`` cuts a micro-batch into smaller ones of consecutive samples.

Each implementation, loss normalization (``num_items_in_batch``), ranks and resume:
docs/training.md, "Use the shards in your own trainer".
"""

from __future__ import annotations

import functools
import inspect

import torch

from vlmshard.errors import ConfigError
from vlmshard.preprocess.tokenize import IGNORE_INDEX

# flash-attn's convention on torch's varlen kernel (``vlmshard.train.attention``): "flash" in
# the name, so ``transformers`` hands it what it hands flash-attn
TORCH_VARLEN = "vlmshard_torch_varlen_as_flash"
FLASH = ("flash_attention_2", "flash_attention_3", TORCH_VARLEN)
MASKED = ("sdpa", "eager")


def next_token_targets(labels: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``labels`` shifted left by one, never across a sample boundary (``cu_seqlens``)."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:-1] = labels[1:]
    # each sample's last token (a scalar fill: assigning a number by index copies it to the
    # device from the host, and the host waits)
    targets.index_fill_(0, cu_seqlens[1:].long() - 1, IGNORE_INDEX)
    return targets


def image_runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of True in a token mask (the image tokens' runs)."""
    zero = torch.zeros(1, dtype=torch.int)
    edges = torch.diff(mask.int(), prepend=zero, append=zero).nonzero().flatten().tolist()
    return list(zip(edges[0::2], edges[1::2]))


def supervised_tokens(batch: dict) -> int:
    """Tokens of a collated micro-batch with a next-token target (the Ave-Token count); a
    sequence-parallel share's labels are its targets already (``vlmshard.shards.sequence``)."""
    targets = (batch["labels"] if "shard" in batch
               else next_token_targets(batch["labels"], batch["cu_seqlens"]))
    return int((targets != IGNORE_INDEX).sum())


def whole_micro_batch(batch: dict) -> None:
    """Refuse a sequence-parallel share (``vlmshard.shards.sequence``): a plain model would
    train it as a micro-batch of its own, shifting its targets again and attending within it."""
    if "shard" in batch:
        raise ConfigError(f"step {batch['step']} is sequence-parallel (vlmshard pack --groups): "
                          f"the loader gave this rank share {batch['shard'].rank} of "
                          f"{batch['shard'].sp}, which only vlmshard train trains; read whole "
                          "micro-batches with ShardDataset.collate(record, share=False)")


def attention_implementation(model) -> str:
    """The implementation the model's language layers use."""
    config = model.config
    text = getattr(config, "get_text_config", lambda: config)()
    return getattr(text, "_attn_implementation", None) or config._attn_implementation


def model_inputs(batch: dict, model, num_items_in_batch: int | float | None = None) -> dict:
    """Keyword arguments for ``model(**...)``: one packed micro-batch from ``ShardDataset``
    (padded to the caps or not), on the model's device, its samples kept apart; raises
    ``ConfigError`` for an attention implementation that cannot keep them apart."""
    whole_micro_batch(batch)
    implementation = attention_implementation(model)
    if implementation not in FLASH + MASKED:
        raise ConfigError(f"attention implementation {implementation!r} cannot keep packed "
                          f"samples apart; load the model with attn_implementation= one of "
                          f"{', '.join(FLASH + MASKED)}")
    kinds = set(getattr(model.config.get_text_config(), "layer_types", None) or ())
    if "linear_attention" in kinds:
        raise ConfigError(f"{model.config.model_type}: transformers' own forward carries its "
                          "linear-attention layers' state from one packed sample into the next; "
                          "train it with vlmshard train, or run each sample alone (split_batch)")
    runs = _bidirectional_images(model)
    if runs and implementation in FLASH:
        raise ConfigError(f"{model.config.model_type} attends to each image both ways, which "
                          "flash-attn's varlen kernel cannot; load it with "
                          "attn_implementation='sdpa'")
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    cu = batch["cu_seqlens"].to(device)
    position_ids = batch["position_ids"]
    inputs = {
        "input_ids": batch["input_ids"][None],
        "labels": batch["labels"][None],
        "shift_labels": next_token_targets(batch["labels"], batch["cu_seqlens"])[None],
        # [1, n], or Qwen2-VL's mRoPE ids [3, 1, n]
        "position_ids": position_ids[None] if position_ids.dim() == 1 else position_ids[:, None],
        "use_cache": False,
    }
    rows = batch["num_pixel_rows"]
    if rows:
        inputs.update(visual_inputs(model, batch["pixel_values"][:rows],
                                    batch.get("image_grid_thw"), batch["media_is_video"],
                                    batch["media_seconds_per_step"]))
    if _forward_takes(type(model), "mm_token_type_ids"):
        inputs["mm_token_type_ids"] = token_types(model, batch["input_ids"],
                                                  batch["image_token_mask"])[None]
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    if implementation in FLASH:
        longest = int((cu[1:] - cu[:-1]).max())
        inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest,
                      max_length_k=longest)
    elif runs or "sliding_attention" in kinds:  # a mask per layer kind, as the model takes it
        window = model.config.get_text_config().sliding_window
        image = inputs["input_ids"][0] == model.config.image_token_id if runs else None
        inputs["attention_mask"] = {kind: packed_mask(
            cu, dtype, image, window if kind == "sliding_attention" else None) for kind in kinds}
    else:
        inputs["attention_mask"] = packed_mask(cu, dtype)
    if num_items_in_batch is not None:
        inputs["num_items_in_batch"] = num_items_in_batch
    return inputs


def visual_inputs(model, pixels: torch.Tensor, grids: torch.Tensor | None,
                  is_video: torch.Tensor, seconds: torch.Tensor) -> dict:
    """The pixel arguments of a model's forward for images and videos in token order: for a
    model with grids (Qwen) the videos' rows go to ``pixel_values_videos`` with their
    ``video_grid_thw`` (and Qwen2.5-VL's ``second_per_grid_ts``); InternVL takes its frames as
    tiles of ``pixel_values`` as they come."""
    if grids is None:
        return {"pixel_values": pixels}
    if not bool(is_video.any()):
        return {"pixel_values": pixels, "image_grid_thw": grids}
    parts = pixels.split(grids.prod(-1).tolist())
    out = {}
    if not bool(is_video.all()):
        out["pixel_values"] = torch.cat([p for p, v in zip(parts, is_video) if not v])
        out["image_grid_thw"] = grids[~is_video]
    out["pixel_values_videos"] = torch.cat([p for p, v in zip(parts, is_video) if v])
    out["video_grid_thw"] = grids[is_video]
    if _forward_takes(type(model), "second_per_grid_ts"):
        out["second_per_grid_ts"] = seconds[is_video]
    return out


def token_types(model, input_ids: torch.Tensor, visual: torch.Tensor) -> torch.Tensor:
    """``mm_token_type_ids``: 1 on image tokens, 2 on video tokens, 0 elsewhere."""
    video = getattr(model.config, "video_token_id", None)
    types = visual.long()
    return types if video is None else types.masked_fill(input_ids == video, 2)


def split_batch(batch: dict, model=None) -> list[dict]:
    """The packed samples of a micro-batch, each alone: ``input_ids`` and ``labels`` [1, len],
    its own ``pixel_values`` rows and ``image_grid_thw`` (when it has images; its videos' as
    ``visual_inputs`` gives them to ``model``, which a sample with videos needs), and
    ``image_token_mask`` [1, len]: what to give the model to run one sample by itself (its own
    position ids and causal mask are then the model's own)."""
    whole_micro_batch(batch)
    cu = batch["cu_seqlens"].tolist()
    grids = batch.get("image_grid_thw")
    samples, row, image = [], 0, 0  # image: the next image or video
    for k in range(batch["num_samples"]):
        a, b = cu[k], cu[k + 1]
        rows, images = int(batch["sample_pixel_rows"][k]), int(batch["sample_images"][k])
        sample = {"input_ids": batch["input_ids"][a:b][None],
                  "labels": batch["labels"][a:b][None],
                  "image_token_mask": batch["image_token_mask"][a:b][None]}
        if rows:
            is_video = batch["media_is_video"][image:image + images]
            pixels = batch["pixel_values"][row:row + rows]
            mine = None if grids is None else grids[image:image + images]
            if model is not None:
                sample.update(visual_inputs(model, pixels, mine, is_video,
                                            batch["media_seconds_per_step"][image:image + images]))
            elif bool(is_video.any()):
                raise ValueError("a sample with videos: pass the model, whose forward decides "
                                 "where their pixels go")
            else:
                sample["pixel_values"] = pixels
                if mine is not None:
                    sample["image_grid_thw"] = mine
        samples.append(sample)
        row, image = row + rows, image + images
    return samples


def split_micro_batch(batch: dict, parts: int) -> list[dict]:
    """A collated micro-batch (not padded to the caps: ``pad_to_caps=False``) as ``parts``
    micro-batches of consecutive samples, each a collated micro-batch of its own, cut where
    their tokens come nearest to equal (none empty): what a trainer that cannot hold the whole
    micro-batch trains with gradient accumulation instead, on the same samples."""
    whole_micro_batch(batch)
    n = int(batch["num_samples"])
    if not 1 <= parts <= n or batch["num_tokens"] != len(batch["input_ids"]):
        raise ValueError(f"cannot split a micro-batch of {n} samples into {parts} parts, or "
                         "one padded to the caps")
    cu = batch["cu_seqlens"].tolist()
    cuts = [0]
    for k in range(1, parts):  # the sample boundary nearest k/parts of the tokens, none empty
        nearest = min(range(n + 1), key=lambda i: abs(cu[i] - cu[-1] * k / parts))
        cuts.append(min(max(nearest, cuts[-1] + 1), n - parts + k))
    cuts.append(n)
    rows = [0] + torch.cumsum(batch["sample_pixel_rows"], 0).tolist()
    items = [0] + torch.cumsum(batch["sample_images"], 0).tolist()
    out = []
    for a, b in zip(cuts, cuts[1:]):
        tokens, media = slice(cu[a], cu[b]), slice(items[a], items[b])
        part = {**batch,
                "input_ids": batch["input_ids"][tokens], "labels": batch["labels"][tokens],
                "position_ids": batch["position_ids"][..., tokens],
                "image_token_mask": batch["image_token_mask"][tokens],
                "cu_seqlens": batch["cu_seqlens"][a:b + 1] - cu[a],
                "pixel_values": batch["pixel_values"][rows[a]:rows[b]],
                "num_tokens": cu[b] - cu[a], "num_samples": b - a,
                "num_pixel_rows": rows[b] - rows[a],
                **{key: batch[key][a:b] for key in ("sample_images", "sample_pixel_rows",
                                                    "sample_ids")},
                **{key: batch[key][media] for key in ("media_tiles", "media_units",
                                                      "media_is_video",
                                                      "media_seconds_per_step",
                                                      "image_grid_thw") if key in batch}}
        part["num_tiles"] = part["tile_cap"] = int(part["media_tiles"].sum())
        out.append(part)
    return out


VISUAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
               "second_per_grid_ts")


def padded_inputs(samples: list[dict], model, num_items_in_batch: int | float | None = None
                  ) -> dict:
    """Keyword arguments for ``model(**...)``: samples (``split_batch(batch, model)``'s) as one
    right-padded batch with an attention mask, as a Hugging Face data collator pads them (the
    common default beside packing; the model makes its own position ids and masks from the
    attention mask), on the model's device. Labels are padded with ``IGNORE_INDEX``."""
    ids = [s["input_ids"][0] for s in samples]
    pad = model.config.get_text_config().pad_token_id or 0
    visual = _right_padded([s["image_token_mask"][0] for s in samples], False)
    inputs = {"input_ids": _right_padded(ids, pad),
              "labels": _right_padded([s["labels"][0] for s in samples], IGNORE_INDEX),
              "attention_mask": _right_padded([torch.ones_like(i) for i in ids], 0),
              "use_cache": False}
    if _forward_takes(type(model), "mm_token_type_ids"):
        inputs["mm_token_type_ids"] = token_types(model, inputs["input_ids"], visual)
    if _bidirectional_images(model):  # Gemma 3: its processor's image runs
        inputs["token_type_ids"] = visual.long()
    for key in VISUAL_KEYS:
        if any(key in s for s in samples):
            inputs[key] = torch.cat([s[key] for s in samples if key in s])
    device = next(model.parameters()).device
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    if num_items_in_batch is not None:
        inputs["num_items_in_batch"] = num_items_in_batch
    return inputs


def _right_padded(rows: list[torch.Tensor], value) -> torch.Tensor:
    """[len(rows), longest] with each row at the start of its own, ``value`` after it."""
    out = rows[0].new_full((len(rows), max(len(r) for r in rows)), value)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


@functools.lru_cache(maxsize=None)
def _forward_takes(model_class: type, name: str) -> bool:
    """Whether the model's forward takes argument ``name`` (``mm_token_type_ids``: Qwen2-VL in
    transformers 5; ``second_per_grid_ts``: Qwen2.5-VL)."""
    return name in inspect.signature(model_class.forward).parameters


def packed_mask(cu_seqlens: torch.Tensor, dtype: torch.dtype, image: torch.Tensor | None = None,
                window: int | None = None) -> torch.Tensor:
    """The additive [1, 1, n, n] mask: 0 where a token may attend (``allowed_keys``: an earlier
    or the same token of its own sample; where ``image`` [n] marks image tokens, every token of
    the same image; within a ``window``), the dtype's lowest value elsewhere."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    segment = torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device),
                                      lengths)
    run = torch.full_like(segment, -1)
    if image is not None:  # consecutive image tokens form one image's run
        starts = image & ~torch.nn.functional.pad(image, (1, 0))[:-1]
        run = torch.where(image, torch.cumsum(starts.long(), 0), run)
    allowed = allowed_keys(segment, run, window)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=cu_seqlens.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def allowed_keys(segment: torch.Tensor, run: torch.Tensor, window: int | None) -> torch.Tensor:
    """[n, n] bool, True where query i may see key j, as ``transformers.masking_utils`` defines
    it: both in one sample (``segment`` ids), and j ≤ i or both in one bidirectional run (``run``
    ids, -1 for none: ``blockwise_overlay``), and with a ``window`` j > i - window
    (``sliding_window_overlay``)."""
    index = torch.arange(len(segment), device=segment.device)
    allowed = (index[None, :] <= index[:, None]) | ((run[:, None] == run[None, :])
                                                    & (run[:, None] >= 0))
    allowed &= segment[:, None] == segment[None, :]
    if window:
        allowed &= index[None, :] > index[:, None] - window
    return allowed


def _bidirectional_images(model) -> bool:
    """Whether the model's family attends to each image both ways (Gemma 3); a model no family
    serves is taken as the others are."""
    from vlmshard.families import model_types
    from vlmshard.families.registry import family_for_model_type

    model_type = model.config.model_type
    return model_type in model_types() and family_for_model_type(
        model_type, "the model").bidirectional_images
