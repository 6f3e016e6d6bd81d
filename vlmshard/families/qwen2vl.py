"""Qwen2-VL and Qwen2.5-VL, as ``transformers`` models them (``Qwen2VLProcessor`` and
``Qwen2VLImageProcessor``; Qwen2.5-VL shares both for images).

Each image: the chat template renders ``<|vision_start|><|image_pad|><|vision_end|>`` and the
``<|image_pad|>`` becomes grid_h·grid_w / merge² of itself; ``smart_resize`` with the folder's
min/max pixels. A *tile* is one merged patch of 28×28 px: the merge² (4) ViT patches that become
one LLM token; the ViT itself runs on ``merge_size²`` patches per tile. Position ids are 3-D
(mRoPE), computed per sample as ``get_rope_index`` does.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from vlmshard.model_sizes import LLMConfig, LLMFeatures, ModelConfig, VisionConfig
from vlmshard.rejects import Reject

from .base import (
    CLIP_MEAN,
    CLIP_STD,
    Family,
    ImageLayout,
    Normalized,
    SampledVideo,
    float_arange,
)
from .folder import ModelFolder, processor_value, video_value
from .tiny import CHAT_TOKENS, CORPUS, save_random_weights, save_tokenizer, save_video_config

if TYPE_CHECKING:
    from PIL import Image


@dataclass(frozen=True)
class Qwen2VLTiling(Normalized):
    """``transformers``' Qwen2-VL processing: ``smart_resize`` to multiples of patch·merge pixels
    with the pixel count in [min_pixels, max_pixels], then flattened ViT patches."""

    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    # videos (Qwen2VLVideoProcessor's defaults; frames sampled at ``fps`` as qwen-vl-utils does)
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 768 * 28 * 28
    cap_pixels_per_frame: bool = True  # each frame's share of a total budget (qwen-vl-utils)
    max_video_tokens: int = 128000
    tokens_per_second: float = 0  # Qwen2.5-VL's temporal position step per second; 0: none
    tokens_per_tile: ClassVar[int] = 1
    takes_grid: ClassVar[bool] = True
    name: ClassVar[str] = "qwen2vl"

    @property
    def tile_size(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def rows_per_tile(self) -> int:
        return self.merge_size ** 2

    @property
    def pixel_shape(self) -> tuple[int, ...]:
        return (3 * self.temporal_patch_size * self.patch_size ** 2,)

    def tiles(self, width: int, height: int, n_images: int) -> int:
        h, w = self.resized(width, height)
        return (h // self.tile_size) * (w // self.tile_size)

    def grid_thw(self, width: int, height: int) -> tuple[int, int, int]:
        """``image_grid_thw`` of an image: (1, ViT patch rows, ViT patch columns)."""
        h, w = self.resized(width, height)
        return 1, h // self.patch_size, w // self.patch_size

    def resized(self, width: int, height: int, min_pixels: int | None = None,
                max_pixels: int | None = None, frames: int | None = None) -> tuple[int, int]:
        """(height, width) after ``smart_resize``. Tiny images are scaled up to ``min_pixels``,
        as current ``transformers`` does; only an aspect ratio over 200 is refused. ``frames``:
        Qwen3-VL's video ``smart_resize``, whose pixel budget is over all of a clip's frames
        (``round(frames / 2) · 2`` of them; sides under a factor scaled up first)."""
        f = self.tile_size
        min_pixels = self.min_pixels if min_pixels is None else min_pixels
        max_pixels = self.max_pixels if max_pixels is None else max_pixels
        t_bar = count = 1  # the frames the budget is over, rounded and as given
        if frames is not None:
            if height < f or width < f:
                scale = max(f / height, f / width)
                height, width = int(height * scale), int(width * scale)
            t = self.temporal_patch_size
            t_bar, count = round(frames / t) * t, frames
        if max(height, width) / min(height, width) > 200:
            raise Reject("bad_aspect_ratio", f"{width}x{height} exceeds the 200:1 aspect ratio "
                                             "Qwen's processors accept")
        h_bar, w_bar = round(height / f) * f, round(width / f) * f
        if t_bar * h_bar * w_bar > max_pixels:
            beta = math.sqrt(count * height * width / max_pixels)
            h_bar = max(f, math.floor(height / beta / f) * f)
            w_bar = max(f, math.floor(width / beta / f) * f)
        elif t_bar * h_bar * w_bar < min_pixels:
            beta = math.sqrt(min_pixels / (count * height * width))
            h_bar = math.ceil(height * beta / f) * f
            w_bar = math.ceil(width * beta / f) * f
        return h_bar, w_bar

    def pixels(self, image: "Image.Image", n_images: int) -> np.ndarray:
        """[patches, 3·T·P·P]: ``Qwen2VLImageProcessor``'s layout, patches ordered by merged
        patch (row-major), then row and column inside it; the frame repeated T times."""
        h, w = self.resized(image.width, image.height)
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        x = self.normalize(self.resize(image, w, h))  # [3, H, W]
        x = x.reshape(3, h // (p * m), m, p, w // (p * m), m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
        return np.ascontiguousarray(x).reshape(-1, 3 * t * p * p)

    def sample_video(self, frames: int, fps: float, width: int, height: int,
                     given: bool = False) -> SampledVideo:
        """``Qwen2VLVideoProcessor.sample_frames`` at ``fps`` (clamped to [min_frames,
        max_frames], floored to whole temporal patches; a clip too short for one keeps its
        frames), then its ``resize`` with the per-frame share of the total pixel budget, and
        the last frame repeated to a whole temporal patch. ``given``: a frame list, all kept."""
        t = self.temporal_patch_size
        if given:
            n = frames
            indices = list(range(frames))
        else:
            most = math.floor(min(self.max_frames, frames) / t) * t
            n = math.floor(min(max(frames / fps * self.fps, self.min_frames), most, frames)
                           / t) * t
            n = n or frames
            # torch.arange's own count (n + 1 where total / n rounds up), as the processor
            # then counts the frames it has
            indices = float_arange(0, frames, frames / n).tolist()
        sampled = len(indices)
        max_pixels = self.video_max_pixels
        if self.cap_pixels_per_frame:
            total = int(self.max_video_tokens * self.tile_size ** 2 * 0.9)
            max_pixels = max(min(max_pixels, total * t // sampled),
                             int(self.video_min_pixels * 1.05))
        h, w = self.resized(width, height, self.video_min_pixels, max_pixels)
        indices += indices[-1:] * (-len(indices) % t)
        grid = (len(indices) // t, h // self.patch_size, w // self.patch_size)
        tokens = grid[0] * grid[1] * grid[2] // self.merge_size ** 2
        sampled_fps = sampled / frames * fps if not given else fps
        return SampledVideo(indices=tuple(indices), width=w, height=h, grid=grid, tiles=tokens,
                            tokens=tokens, seconds_per_step=t / sampled_fps, fps=fps)

    def video_pixels(self, frames: list["Image.Image"], video: SampledVideo) -> np.ndarray:
        """[patches, 3·T·P·P]: ``Qwen2VLVideoProcessor``'s layout, two consecutive frames per
        temporal patch, patches ordered by temporal step, then as an image's."""
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        x = self.normalize(np.stack([self.resize(f, video.width, video.height) for f in frames]))
        gt, gh, gw = video.grid
        x = x.reshape(gt, t, 3, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return np.ascontiguousarray(x).reshape(-1, 3 * t * p * p)


# Qwen2-VL-Instruct's template (image, video and text items, default system prompt).
TEMPLATE = (
    "{% set image_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


# Qwen2's attention: biases on q, k and v (its config.json states no ``attention_bias``).
LLM_FEATURES = LLMFeatures(qkv_bias=True)

PRESETS = {
    # Qwen2-VL-2B: its 675M ViT + Qwen2-1.5B, whose LM head is its token embedding. The ViT
    # unit is a merged patch (28 px: 2×2 patches of 14 px, one LLM token after the merger), as
    # the Qwen2-VL stats count it; its attention spans each image (``CostTerms.vit_squares``).
    "qwen2-vl-2b": ModelConfig(
        name="qwen2-vl-2b",
        vision=VisionConfig(image_size=28, patch_size=14, hidden=1280, layers=32, heads=16,
                            position_embeddings=0, temporal_patch=2, patch_bias=False,
                            fused_qkv=True, quick_gelu=True),
        llm=LLMConfig(vocab_size=151936, hidden=1536, layers=28, heads=12, kv_heads=2,
                      intermediate=8960, tied_embeddings=True, **asdict(LLM_FEATURES)),
        downsample_ratio=0.5, projector="merger"),
}


class Qwen2VL(Family):
    name = "qwen2vl"
    model_types = ("qwen2_vl", "qwen2_5_vl")
    policies = (Qwen2VLTiling,)
    presets = PRESETS
    default_preset = "qwen2-vl-2b"
    # its LLM's features config.json does not state (each Qwen family below states its own)
    llm_features: ClassVar[LLMFeatures] = LLM_FEATURES
    trainer_layers = "vlmshard.train.models.qwen2vl:layers"
    description = "Qwen2-VL, Qwen2.5-VL"
    demo_limits = {"max_pixels": 28 * 28 * 256}  # up to 256 merged patches an image

    defaults: ClassVar[Qwen2VLTiling] = Qwen2VLTiling()  # where the folder states nothing

    def default_tiling(self) -> Qwen2VLTiling:
        return self.defaults

    def tiling(self, folder: ModelFolder) -> Qwen2VLTiling:
        d = self.defaults
        size = processor_value(folder, "size", None) or {}
        # transformers: min_pixels / max_pixels, when given, override size's edges
        min_pixels = processor_value(folder, "min_pixels", size.get("shortest_edge", d.min_pixels))
        max_pixels = processor_value(folder, "max_pixels", size.get("longest_edge", d.max_pixels))
        return type(d)(
            patch_size=int(processor_value(folder, "patch_size", d.patch_size)),
            merge_size=int(processor_value(folder, "merge_size", d.merge_size)),
            temporal_patch_size=int(processor_value(folder, "temporal_patch_size",
                                                    d.temporal_patch_size)),
            min_pixels=int(min_pixels), max_pixels=int(max_pixels),
            mean=tuple(processor_value(folder, "image_mean", d.mean)),
            std=tuple(processor_value(folder, "image_std", d.std)),
            resample=int(processor_value(folder, "resample", d.resample)),
            rescale_factor=float(processor_value(folder, "rescale_factor", d.rescale_factor)),
            **self.video_rules(folder))

    def video_rules(self, folder: ModelFolder) -> dict:
        """The video processor config's sampling and size limits, and the model's temporal
        position step (Qwen2.5-VL's ``vision_config.tokens_per_second``)."""
        d = self.defaults
        size = video_value(folder, "size", None) or {}
        vision = folder.config.get("vision_config") or {}
        return dict(
            fps=float(video_value(folder, "fps", d.fps)),
            min_frames=int(video_value(folder, "min_frames", d.min_frames)),
            max_frames=int(video_value(folder, "max_frames", d.max_frames)),
            video_min_pixels=int(video_value(folder, "min_pixels",
                                             size.get("shortest_edge", d.video_min_pixels))),
            video_max_pixels=int(video_value(folder, "max_pixels",
                                             size.get("longest_edge", d.video_max_pixels))),
            cap_pixels_per_frame=bool(video_value(folder, "cap_pixels_per_frame",
                                                  d.cap_pixels_per_frame)),
            max_video_tokens=int(video_value(folder, "max_video_tokens", d.max_video_tokens)),
            # transformers' Qwen2_5_VLVisionConfig default: 4
            tokens_per_second=float(vision.get("tokens_per_second", 4)
                                    if folder.config.get("model_type") == "qwen2_5_vl" else 0))

    def video_layout(self, folder: ModelFolder) -> ImageLayout:
        token = folder.special_tokens().get("video_token", "<|video_pad|>")
        return ImageLayout(placeholder=token, token=token)

    def layout(self, folder: ModelFolder) -> ImageLayout:
        token = folder.special_tokens().get("image_token", "<|image_pad|>")
        return ImageLayout(placeholder=token, token=token)

    def model_sizes(self, config: dict, name: str) -> ModelConfig:
        """The unit: one merged patch (``spatial_merge_size``² ViT patches, one LLM token)."""
        vision = config["vision_config"]
        hidden = vision["embed_dim"] if config["model_type"] == "qwen2_vl" \
            else vision["hidden_size"]
        mlp = vision.get("mlp_ratio") or vision["intermediate_size"] / hidden
        merge = vision.get("spatial_merge_size", 2)
        # Qwen2.5-VL's ViT: SwiGLU MLPs, RMSNorms, and windows of window_size px but on its
        # full-attention blocks (transformers' Qwen2_5_VLVisionConfig defaults: 112 px; 7, 15,
        # 23 and 31)
        swiglu = config["model_type"] == "qwen2_5_vl"
        windows = dict(window=vision.get("window_size", 112) // merge // vision["patch_size"],
                       full_blocks=tuple(i for i in vision.get("fullatt_block_indexes",
                                                               (7, 15, 23, 31))
                                         if i < vision["depth"]))
        vit = VisionConfig(image_size=vision["patch_size"] * merge,
                           patch_size=vision["patch_size"], hidden=hidden, layers=vision["depth"],
                           heads=vision["num_heads"], mlp_ratio=mlp,
                           temporal_patch=vision.get("temporal_patch_size", 2),
                           gated_mlp=swiglu, rms_norm=swiglu, fused_qkv=True,
                           quick_gelu=vision.get("hidden_act") == "quick_gelu",
                           **(windows if swiglu else {}), **self.vision_extras(vision))
        model = ModelConfig(name=name, vision=vit,
                            llm=LLMConfig.from_hf_config(config, self.llm_features),
                            downsample_ratio=1 / merge, projector="merger")
        model.validate()
        return model

    def vision_extras(self, vision: dict) -> dict:
        """``VisionConfig`` fields the family's ViT sets: Qwen2-VL's has rotary positions only and
        a patch embedding without bias."""
        return {"position_embeddings": 0, "patch_bias": False}

    def tiny_folder(self, path: str, model_type: str = "qwen2_vl", *,
                    min_pixels: int = 56 * 56, max_pixels: int = 28 * 28 * 64,
                    corpus: list[str] = CORPUS, vocab_size: int = 420, seed: int = 0,
                    init_std: float = 0.2, text_sizes: dict | None = None,
                    vision_sizes: dict | None = None) -> str:
        """``text_sizes`` and ``vision_sizes`` override the configs' sizes (e.g. 8 query heads
        for a sequence-parallel degree of 8)."""
        from transformers import Qwen2_5_VLConfig, Qwen2VLConfig
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        os.makedirs(path, exist_ok=True)
        vocab = save_tokenizer(path, TOKENS, TEMPLATE, {"image_token": "<|image_pad|>",
                                                        "video_token": "<|video_pad|>"},
                               corpus, vocab_size)
        ids = {t: i for i, t in enumerate(CHAT_TOKENS)}
        if model_type == "qwen2_vl":
            config_class = Qwen2VLConfig
            vision = dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2)
        else:  # qwen2_5_vl: a windowed ViT, 4x4 merged patches a window, block 1 full
            config_class = Qwen2_5_VLConfig
            vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                          out_hidden_size=32, window_size=112, fullatt_block_indexes=[1])
        config = config_class(
            text_config=dict(dict(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2,
                                  rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]},
                                  bos_token_id=ids["<|endoftext|>"],
                                  eos_token_id=ids["<|im_end|>"]), **(text_sizes or {})),
            vision_config=dict(vision, spatial_merge_size=2, patch_size=14, temporal_patch_size=2,
                               **(vision_sizes or {})),
            image_token_id=vocab - 2, video_token_id=vocab - 1,
            vision_start_token_id=vocab - 4, vision_end_token_id=vocab - 3,
            bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
        config.save_pretrained(path)
        Qwen2VLImageProcessorPil(min_pixels=min_pixels,
                                 max_pixels=max_pixels).save_pretrained(path)
        save_video_config(path, "Qwen2VLVideoProcessor", {
            "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels}, "fps": 2.0,
            "min_frames": 4, "max_frames": 768, "do_sample_frames": True,
            "cap_pixels_per_frame": True, "patch_size": 14, "temporal_patch_size": 2,
            "merge_size": 2, "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD)})
        save_random_weights(path, seed, init_std)
        return path

    def position_ids(self, input_ids: np.ndarray, visual_ids: tuple[int, ...],
                     grids: list[tuple[int, int, int]], policy: Qwen2VLTiling,
                     steps: list[float] | None = None) -> np.ndarray:
        """[3, n] mRoPE ids as ``transformers``' ``get_rope_index`` numbers them: text runs
        count up on all three axes; an image's or video's tokens take (t, row, column) of its
        merged grid offset by the position it starts at, the temporal axis scaled by
        ``tokens_per_second`` × its seconds per temporal step (Qwen2.5-VL's videos; float32,
        truncated); the text after it resumes at that offset + max(rows, columns)."""
        n, merge = len(input_ids), policy.merge_size
        out = np.empty((3, n), dtype=np.int64)
        is_visual = np.isin(input_ids, visual_ids)
        i = pos = 0
        items = iter(zip(grids, steps or [0.0] * len(grids)))
        while i < n:
            if not is_visual[i]:
                later = np.flatnonzero(is_visual[i:])
                j = i + int(later[0]) if len(later) else n
                out[:, i:j] = pos + np.arange(j - i)
                pos += j - i
                i = j
                continue
            (t, h, w), step = next(items)
            rows, cols = h // merge, w // merge
            count = t * rows * cols
            if i + count > n or not is_visual[i:i + count].all():
                raise ValueError(f"visual tokens at {i} do not hold the {count} of grid "
                                 f"{t}x{h}x{w}")
            interval = np.float32(policy.tokens_per_second * np.float32(step)) \
                if step and policy.tokens_per_second else np.float32(1)
            temporal = (np.arange(t, dtype=np.float32) * interval).astype(np.int64)
            tt, hh, ww = np.meshgrid(temporal, np.arange(rows), np.arange(cols), indexing="ij")
            out[:, i:i + count] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + pos
            pos += max(rows, cols)
            i += count
        return out
