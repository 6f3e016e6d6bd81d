"""The truth for the trainer: the ``transformers`` model itself, run on one sample at a time.

For each packed sample of the loader's micro-batches: its tokens, its own pixel rows (and image
grids for Qwen2-VL), its labels, through ``AutoModelForImageTextToText.forward(labels=...)``
with ``use_cache=False`` and the model's own position ids. Its mean loss times its count of
supervised tokens is its summed loss; the gradients are those of the sum over all samples.
"""

from __future__ import annotations

import glob
import inspect
import json
import os

import torch
import torch.nn.functional as F

from vlmshard.families import tiny_folder
from vlmshard.packing.config import PackConfig
from vlmshard.packing.plan import run_pack
from vlmshard.preprocess import PreprocessConfig, run_preprocess
from vlmshard.shards.config import WriteConfig
from vlmshard.shards.writer import run_write

FAMILIES = ("internvl", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe",
            "internvl3_5_moe", "qwen3_5", "qwen3_5_moe", "gemma3")


def _photo(name: str) -> str:
    import skimage

    return os.path.join(os.path.dirname(skimage.__file__), "data", name)


ROWS = [
    {"image": [_photo("astronaut.png"), _photo("rocket.jpg")], "conversations": [
        {"from": "human", "value": "<image>\nFirst. <image>\nSecond?"},
        {"from": "gpt", "value": "A person and a rocket."},
        {"from": "human", "value": "Which is taller?"}, {"from": "gpt", "value": "The rocket."}]},
    {"image": _photo("chelsea.png"), "conversations": [
        {"from": "human", "value": "What animal is this?"}, {"from": "gpt", "value": "A cat."}]},
    {"conversations": [{"from": "human", "value": "Hello there"},
                       {"from": "gpt", "value": "Hi! How can I help?"}]},
    {"image": _photo("coffee.png"), "conversations": [
        {"from": "human", "value": "<image>\nWhat is in the cup?"},
        {"from": "gpt", "value": "Coffee, with a pattern of foam."}]},
    {"image": _photo("motorcycle_left.png"), "conversations": [
        {"from": "human", "value": "<image>\nWhat vehicle?"},
        {"from": "gpt", "value": "A motorcycle."}]},
]


def make_folder(family: str, path: str, **sizes) -> str:
    """A tiny folder of ``family``: a model_type, or ``internvl3_5_moe`` (InternVL on Qwen3-MoE,
    as InternVL3.5-30B-A3B; its checkpoint stores each expert apart), or
    ``internvl_final_norm`` (InternViT's final LayerNorm before the projector:
    ``use_mean_pooling`` false; ViT and LLM widths of their own). ``sizes`` go to the family's
    ``tiny_folder``."""
    if family == "internvl":
        return tiny_folder("internvl", path, max_patches=2, **sizes)
    if family == "internvl_final_norm":
        return tiny_folder("internvl", path, max_patches=2,
                           vision_sizes={"use_mean_pooling": False, "hidden_size": 40},
                           text_sizes={"hidden_size": 48})
    if family == "internvl3_5_moe":
        return tiny_folder("internvl", path, max_patches=2, llm="qwen3_moe")
    if family == "gemma3":
        return tiny_folder("gemma3", path)
    if family.startswith(("qwen3_vl", "qwen3_5")):
        return tiny_folder(family, path, max_pixels=32 * 32 * 64, **sizes)
    return tiny_folder(family, path, max_pixels=28 * 28 * 64, **sizes)


def make_shards(folder: str, root, rows=ROWS, **pack) -> str:
    """Shards of ``rows``: a list, or "videos" (``video_rows``) or "mixed" (``ROWS`` and the
    video rows but their text-only one, which is ``ROWS[2]``)."""
    if rows == "videos":
        rows = video_rows(root)
    elif rows == "mixed":
        rows = ROWS + video_rows(root)[:-1]
    with open(root / "rows.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    run_preprocess(PreprocessConfig(inputs=[str(root / "rows.jsonl")], out=str(root / "pre"),
                                    model=folder, workers=1))
    run_pack(PackConfig(stats=str(root / "pre"), dp=1, out=str(root / "plan"), **pack))
    run_write(WriteConfig(plan=str(root / "plan"), stats=str(root / "pre"),
                          out=str(root / "shards"), workers=1))
    return str(root / "shards")


def video_rows(root) -> list[dict]:
    """Rows with videos, their clips made here from the photos: an MP4 pan (20 frames at 8 fps)
    asked about alone, an MKV zoom (12 frames) after an image in one user turn, a list of three
    frame images (an odd count: Qwen repeats the last), and a text-only row."""
    from PIL import Image

    from vlmshard.demo.clips import Clip, make_clip

    clips = {"pan.mp4": ("astronaut.png", Clip(frames=20, fps=8)),
             "zoom.mkv": ("coffee.png", Clip(frames=12, fps=6, motion="zoom", container="mkv"))}
    for name, (photo, clip) in clips.items():
        with Image.open(_photo(photo)) as im:
            (root / name).write_bytes(make_clip(im, clip))
    frames = []
    for k, photo in enumerate(("chelsea.png", "rocket.jpg", "camera.png")):
        with Image.open(_photo(photo)) as im:
            im.convert("RGB").resize((112, 84)).save(root / f"frame{k}.png")
        frames.append(str(root / f"frame{k}.png"))
    return [
        {"videos": [str(root / "pan.mp4")], "conversations": [
            {"from": "human", "value": "<video>\nWhere does the camera move?"},
            {"from": "gpt", "value": "From left to right."}]},
        {"images": [_photo("motorcycle_left.png")], "videos": [str(root / "zoom.mkv")],
         "conversations": [{"from": "human", "value": "<image>\nAnd <video>: the same cup?"},
                           {"from": "gpt", "value": "No: a motorcycle, then a cup."}]},
        {"videos": [frames], "conversations": [
            {"from": "human", "value": "<video>\nName the three scenes."},
            {"from": "gpt", "value": "A cat, a rocket, a photographer."}]},
        ROWS[2],
    ]


def clip_rows(root) -> list[dict]:
    """A long clip (64 frames at 8 fps: 8 temporal steps where Qwen samples 2 fps) asked about
    alone, beside an image row and the text-only row: at SP 2 to 8 the clip's steps spread
    over the group's ranks."""
    from PIL import Image

    from vlmshard.demo.clips import Clip, make_clip

    with Image.open(_photo("astronaut.png")) as im:
        (root / "long.mp4").write_bytes(make_clip(im, Clip(frames=64, fps=8)))
    return [{"videos": [str(root / "long.mp4")], "conversations": [
        {"from": "human", "value": "<video>\nWhere does the camera move?"},
        {"from": "gpt", "value": "From left to right."}]}, ROWS[1], ROWS[2]]


def split_samples(batch: dict, image_token_id: int, tokens_per_tile: int,
                  rows_per_tile: int, video_token_id: int | None = None) -> list[dict]:
    """The samples of a collated micro-batch, each with its own inputs for the HF model. With
    ``video_token_id`` (Qwen), each run of image or video tokens takes the next grid; a video's
    rows go to ``pixel_values_videos`` with its ``video_grid_thw`` and seconds per step."""
    if video_token_id is not None and bool(batch["media_is_video"].any()):
        return _split_with_videos(batch, image_token_id, video_token_id)
    cu = batch["cu_seqlens"].tolist()
    grids = list(batch.get("image_grid_thw", []))
    samples, row = [], 0
    for start, end in zip(cu, cu[1:]):
        if start >= batch["num_tokens"]:
            break  # the padding's segment
        ids = batch["input_ids"][start:end]
        sample = {"input_ids": ids[None], "labels": batch["labels"][start:end][None]}
        tiles = int((ids == image_token_id).sum()) // tokens_per_tile
        if tiles:
            rows = tiles * rows_per_tile
            sample["pixel_values"] = batch["pixel_values"][row:row + rows]
            row += rows
            if grids:
                mine = []
                while rows > 0:
                    mine.append(grids.pop(0))
                    rows -= int(mine[-1].prod())
                sample["image_grid_thw"] = torch.stack(mine)
                sample["mm_token_type_ids"] = (ids == image_token_id).int()[None]
        samples.append(sample)
    return samples


def _split_with_videos(batch: dict, image_token_id: int, video_token_id: int) -> list[dict]:
    cu = batch["cu_seqlens"].tolist()
    grids = iter(batch["image_grid_thw"])
    seconds = iter(batch["media_seconds_per_step"])
    samples, row = [], 0
    for start, end in zip(cu, cu[1:]):
        if start >= batch["num_tokens"]:
            break
        ids = batch["input_ids"][start:end]
        sample = {"input_ids": ids[None], "labels": batch["labels"][start:end][None],
                  "mm_token_type_ids": ((ids == image_token_id).int()
                                        + 2 * (ids == video_token_id).int())[None]}
        parts: dict[str, list] = {"pixel_values": [], "image_grid_thw": [],
                                  "pixel_values_videos": [], "video_grid_thw": [],
                                  "second_per_grid_ts": []}
        i = 0
        while i < len(ids):
            token = int(ids[i])
            if token not in (image_token_id, video_token_id):
                i += 1
                continue
            grid, step = next(grids), next(seconds)
            rows = int(grid.prod())
            video = token == video_token_id
            parts["pixel_values_videos" if video else "pixel_values"].append(
                batch["pixel_values"][row:row + rows])
            parts["video_grid_thw" if video else "image_grid_thw"].append(grid)
            if video:
                parts["second_per_grid_ts"].append(step)
            row += rows
            left = rows // 4  # its tokens; Qwen3-VL's frames are runs apart, text between
            while left:
                left -= int(ids[i]) == token
                i += 1
        for key, value in parts.items():
            if value:
                sample[key] = torch.cat(value) if key.startswith("pixel") else torch.stack(value)
        samples.append(sample)
    return samples


def with_token_types(model, samples: list[dict]) -> list[dict]:
    """``samples`` with the ``token_type_ids`` Gemma 3's processor adds (its image tokens: the
    runs its mask attends both ways); other models' unchanged."""
    if model.config.model_type == "gemma3":
        for sample in samples:
            sample["token_type_ids"] = (sample["input_ids"] == model.config.image_token_id).long()
    return samples


def supervised(sample: dict) -> int:
    return int((sample["labels"][0, 1:] != -100).sum())


def padded(samples: list[dict]) -> dict:
    """Samples as one right-padded batch with an attention mask, as a HF data collator makes."""
    width = max(s["input_ids"].shape[1] for s in samples)
    batch = {"attention_mask": torch.stack([torch.arange(width) < s["input_ids"].shape[1]
                                            for s in samples]).long()}
    for key in ("input_ids", "mm_token_type_ids"):
        batch[key] = torch.stack([F.pad(s[key][0] if key in s else torch.zeros_like(
            s["input_ids"][0], dtype=torch.int), (0, width - s["input_ids"].shape[1]))
            for s in samples])
    for key in ("pixel_values", "image_grid_thw"):
        if any(key in s for s in samples):
            batch[key] = torch.cat([s[key] for s in samples if key in s])
    return batch


def hf_loss_and_grads(folder: str, batches: list[dict], tokens_per_tile: int,
                      rows_per_tile: int, trains=None, prepare=None
                      ) -> tuple[float, int, dict[str, torch.Tensor]]:
    """(J, supervised tokens, gradients of J by parameter name). J is Σ per-token losses, and
    for a MoE model trained with the router's auxiliary loss (``output_router_logits``), plus
    tokens × coef × the mean over micro-batches of the aux loss HF computes on each micro-batch
    (its samples as one padded batch): J / tokens is then the step's loss. ``trains(name)``:
    whether parameter ``name`` trains (the others' ``requires_grad`` off; default: all).
    ``prepare(model)``: the model to run instead (a ``peft.PeftModel`` of it)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32,
                                                        attn_implementation="sdpa")
    for name, p in model.named_parameters():
        p.requires_grad_(trains is None or trains(name))
    forward = type(model).forward  # what the model's own forward takes
    if prepare is not None:
        model = prepare(model)
    model.train()
    text = model.config.get_text_config()
    coef = text.router_aux_loss_coef if getattr(text, "output_router_logits", False) else 0.0
    image_token_id = model.config.image_token_id
    video_token_id = getattr(model.config, "video_token_id", None)
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    micro = [with_token_types(model, split_samples(batch, image_token_id, tokens_per_tile,
                                                   rows_per_tile, video_token_id))
             for batch in batches]
    if "second_per_grid_ts" not in inspect.signature(forward).parameters:
        for sample in (s for samples in micro for s in samples):
            sample.pop("second_per_grid_ts", None)
    for samples in micro:
        for sample in samples:
            n = supervised(sample)
            out = model(**sample, use_cache=False, **({"output_router_logits": False}
                                                      if coef else {}))
            loss = out.loss * n
            if loss.requires_grad:  # not where nothing trained touches the sample
                loss.backward()
            total += loss.detach().double()
            count += n
    for samples in micro if coef else []:
        aux = model(**padded(samples), use_cache=False, output_router_logits=True).aux_loss
        weighted = aux * (coef * count / len(micro))
        weighted.backward()
        total += weighted.detach().double()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return float(total), count, grads


def pipeline_grads(run, model) -> dict[str, dict[str, torch.Tensor]]:
    """Per pipeline stage, the gradients of the first optimizer step by checkpoint name, read
    back from DeepSpeed's own checkpoint: AdamW's first moment after one step from zero is
    (1 - beta1) x gradient, the data-parallel and tied-weight all-reduces included. A stage
    that trains nothing has none."""
    stages = {}
    pattern = run / "checkpoints" / "step-1" / "mp_rank_*_model_states.pt"
    for path in sorted(glob.glob(str(pattern))):
        state = torch.load(path, weights_only=False)
        groups = state["optimizer"]["param_groups"]  # none on a stage that trains nothing
        names = state["parameters"]  # the trainer's record of the optimizer's order
        grads = {}
        for index, name in zip([i for g in groups for i in g["params"]], names):
            beta1 = groups[0]["betas"][0]
            layer, local = name.split(".", 1)
            if layer == "tied_modules":  # tied_modules.KEY.inner...: the embedding's
                i, local = model.names.index("embed_tokens"), local.split(".", 1)[1]
            else:
                i = int(layer)
            hf = model.defs[i].build(model.meta).hf_name(local.removeprefix("inner."))
            grads[hf] = state["optimizer"]["state"][index]["exp_avg"] / (1 - beta1)
        stages[os.path.basename(path)] = grads
    return stages


def grad_floor(grads: dict[str, torch.Tensor]) -> float:
    """``assert_grad_close``'s floor for a step's gradients."""
    return 1e-8 * max(float(g.abs().max()) for g in grads.values())


def assert_grad_close(name: str, got: torch.Tensor, want: torch.Tensor, floor: float) -> None:
    """A pipeline gradient against the HF model's (fp32): rtol 1e-4, atol 1e-5 of the largest,
    and at least ``floor`` (1e-8 of the step's largest gradient: a key projection's bias has a
    gradient of zero in exact arithmetic, so only rounding is left to compare).
    A Gated DeltaNet's per-head decay parameters (``A_log``, ``dt_bias``) sum their gradient
    through every token's state of every sample, and in the tiny MoE model rounding moves them
    most: HF's own gradients move by 4e-5 of the largest when every weight is perturbed by 1e-7
    (float32's rounding), so 1e-4 there (a sample leaking into the next moved them by 48%)."""
    decay = name.endswith(("linear_attn.A_log", "linear_attn.dt_bias"))
    torch.testing.assert_close(got, want, rtol=1e-4,
                               atol=max((1e-4 if decay else 1e-5) * float(want.abs().max()),
                                        floor),
                               msg=lambda m: f"{name}: {m}")
