"""InternVL (2.5, 3), as ``transformers`` models it natively (``InternVLForConditionalGeneration``,
``InternVLProcessor`` with ``GotOcr2ImageProcessor``), whatever LLM it ships with.

Each image: ``<img>`` + ``<IMG_CONTEXT>`` × 256 per tile + ``</img>``, where the chat template
renders one ``<IMG_CONTEXT>`` per image; 448-px tiles chosen by aspect ratio, plus a thumbnail
(``GotOcr2ImageProcessor`` with ``crop_to_patches``). A *tile* is one 448×448 crop, the ViT's unit
of work; ``tokens_per_tile`` (256) image tokens each. Position ids run 0..n-1 per sample.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from vlmshard.errors import ConfigError
from vlmshard.model_sizes import LLMConfig, LLMFeatures, ModelConfig, VisionConfig

from .base import (
    BICUBIC,
    IMAGENET_MEAN,
    IMAGENET_STD,
    Family,
    ImageLayout,
    Normalized,
    SampledVideo,
    SquareTiles,
    TileBudget,
    float_arange,
)
from .folder import ModelFolder, processor_value, video_value
from .tiny import CORPUS, save_random_weights, save_tokenizer, save_video_config

if TYPE_CHECKING:
    from PIL import Image


@dataclass(frozen=True)
class InternVLTiling(SquareTiles, Normalized):
    """``transformers``' InternVL processing: crop to a grid of tiles chosen by aspect ratio, then
    a thumbnail of the whole image when there is more than one tile."""

    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    image_size: int = 448
    min_patches: int = 1
    max_patches: int = 12
    crop_to_patches: bool = True
    tokens_per_tile: int = 256
    budget: TileBudget = "per-image"
    num_frames: int = 8  # frames sampled per video (InternVL's own num_segments)
    name: ClassVar[str] = "internvl"

    def with_limits(self, max_patches: int | None = None,
                    budget: TileBudget | None = None) -> "InternVLTiling":
        return replace(self, max_patches=max_patches or self.max_patches,
                       budget=budget or self.budget)

    def grid(self, width: int, height: int, n_images: int) -> tuple[int, int]:
        """(columns, rows) of crops, or (1, 1) when the image is only resized."""
        max_patches = self.max_patches
        if self.budget == "per-sample":
            max_patches = max(1, max_patches // max(1, n_images))
        if not self.crop_to_patches or max_patches <= 1:
            return 1, 1
        return tiled_canvas(width, height, min(self.min_patches, max_patches), max_patches,
                            self.image_size)

    def tiles(self, width: int, height: int, n_images: int) -> int:
        cols, rows = self.grid(width, height, n_images)
        return cols * rows + (cols * rows != 1)  # the thumbnail

    def pixels(self, image: "Image.Image", n_images: int) -> np.ndarray:
        """[tiles, 3, S, S]: the crops row-major, then the thumbnail."""
        cols, rows = self.grid(image.width, image.height, n_images)
        size = self.image_size
        tiles = _cut_grid(self.resize(image, cols * size, rows * size), rows, cols, size)
        if cols * rows != 1:
            tiles = np.concatenate([tiles, self.resize(image, size, size)[None]])
        return self.normalize(tiles)

    def sample_video(self, frames: int, fps: float, width: int, height: int,
                     given: bool = False) -> SampledVideo:
        """``InternVLVideoProcessor.sample_frames`` with ``num_frames`` (the middle of each of
        as many equal segments); each frame one tile of the model's image size (a video config
        sizing frames otherwise would not give the model's tiles). ``given``: a frame list, all
        kept."""
        n = frames if given else min(self.num_frames, frames)
        indices = range(frames) if given else float_arange(frames / n / 2, frames, frames / n)
        return SampledVideo(indices=tuple(int(i) for i in indices), width=self.image_size,
                            height=self.image_size, grid=(n, 1, 1), tiles=n,
                            tokens=n * self.tokens_per_tile, seconds_per_step=1 / fps, fps=fps)

    def video_pixels(self, frames: list["Image.Image"], video: SampledVideo) -> np.ndarray:
        """[frames, 3, S, S]: each frame resized whole, as the video processor does."""
        return self.normalize(np.stack([self.resize(f, video.width, video.height)
                                        for f in frames]))


@lru_cache(maxsize=65536)
def tiled_canvas(width: int, height: int, min_tiles: int, max_tiles: int,
                 tile: int) -> tuple[int, int]:
    """The (columns, rows) grid ``transformers``' ``get_optimal_tiled_canvas`` picks.

    Grids with min ≤ columns·rows ≤ max, enumerated by columns then rows and sorted stably by
    area; the closest aspect ratio wins; on a tie the later (larger) grid wins while the image
    covers more than half of its pixels. Cached: sizes repeat a lot and the search is ~50 µs.
    """
    grids = sorted(((c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles + 1)
                    if min_tiles <= c * r <= max_tiles), key=lambda g: g[0] * g[1])
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for cols, rows in grids:
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and area > 0.5 * tile * tile * cols * rows:
            best = (cols, rows)
    return best


def _cut_grid(pixels: np.ndarray, rows: int, cols: int, size: int) -> np.ndarray:
    """An image of exactly (cols·size) × (rows·size) px as row-major tiles
    [rows·cols, S, S, 3]."""
    return (pixels.reshape(rows, size, cols, size, 3).transpose(0, 2, 1, 3, 4)
            .reshape(rows * cols, size, size, 3))


# transformers' InternVL (-hf checkpoints) template: '<IMG_CONTEXT>\n' per image, '<video>\n'
# per video.
TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{'<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}")
TOKENS = ["<img>", "</img>", "<IMG_CONTEXT>", "<video>"]


# The features of the LLMs InternVL ships with (``text_config.model_type``; transformers'
# default: qwen2), as their ``transformers`` modules build them: Qwen2's q/k/v biases, Qwen3's
# q/k norms; InternLM2 and Llama have neither.
LLM_FEATURES = {"qwen2": LLMFeatures(qkv_bias=True), "qwen2_moe": LLMFeatures(qkv_bias=True),
                "qwen3": LLMFeatures(qk_norm=True), "qwen3_moe": LLMFeatures(qk_norm=True),
                "internlm2": LLMFeatures(), "llama": LLMFeatures()}

PRESETS = {
    # InternVL2-2B: InternViT-300M-448px + InternLM2-1.8B.
    "internvl2-2b": ModelConfig(
        name="internvl2-2b",
        vision=VisionConfig(hidden=1024, layers=24, heads=16, layer_scale=True, cls_token=True),
        llm=LLMConfig(vocab_size=92553, hidden=2048, layers=24, heads=16, kv_heads=8,
                      intermediate=8192, **asdict(LLM_FEATURES["internlm2"]))),
    # InternVL-Chat-V1.5: InternViT-6B-448px-V1-5 + InternLM2-Chat-20B (OmniBal's main setting).
    "internvl-chat-1.5": ModelConfig(
        name="internvl-chat-1.5",
        vision=VisionConfig(hidden=3200, layers=45, heads=25, qkv_bias=False, layer_scale=True,
                            cls_token=True),
        llm=LLMConfig(vocab_size=92544, hidden=6144, layers=48, heads=48, kv_heads=8,
                      intermediate=16384, **asdict(LLM_FEATURES["internlm2"]))),
}


class InternVL(Family):
    name = "internvl"
    model_types = ("internvl",)
    policies = (InternVLTiling,)
    presets = PRESETS
    default_preset = "internvl2-2b"
    trainer_layers = "vlmshard.train.models.internvl:layers"
    description = "InternVL"
    demo_limits = {"max_patches": 12}  # the demo's photos make up to 12 tiles

    def tiling(self, folder: ModelFolder) -> InternVLTiling:
        size = processor_value(folder, "size", {"height": 448, "width": 448})
        return InternVLTiling(
            image_size=int(size["height"]),
            min_patches=int(processor_value(folder, "min_patches", 1)),
            max_patches=int(processor_value(folder, "max_patches", 12)),
            crop_to_patches=bool(processor_value(folder, "crop_to_patches", True)),
            tokens_per_tile=int(processor_value(folder, "image_seq_length",
                                                _tokens_per_tile(folder.config))),
            mean=tuple(processor_value(folder, "image_mean", IMAGENET_MEAN)),
            std=tuple(processor_value(folder, "image_std", IMAGENET_STD)),
            resample=int(processor_value(folder, "resample", BICUBIC)),
            rescale_factor=float(processor_value(folder, "rescale_factor", 1 / 255)),
            num_frames=int(video_value(folder, "num_frames", 8)))

    def video_layout(self, folder: ModelFolder) -> ImageLayout:
        """``<video>`` becomes a ``Frame{i}: <img>…</img>`` line per frame (``video_pieces``)."""
        image = self.layout(folder)
        return ImageLayout(placeholder=folder.special_tokens().get("video_token", "<video>"),
                           token=image.token, prefix=image.prefix, suffix=image.suffix)

    def video_pieces(self, video: SampledVideo, layout: ImageLayout) -> list[str | int]:
        """``InternVLProcessor``: the frames' lines joined by line breaks."""
        per_frame = video.tokens // video.tiles
        pieces: list[str | int] = []
        for i in range(video.tiles):
            pieces += [("\n" if i else "") + f"Frame{i + 1}: ", per_frame]
        return pieces

    def layout(self, folder: ModelFolder) -> ImageLayout:
        tokens = folder.special_tokens()
        context = tokens.get("context_image_token", "<IMG_CONTEXT>")
        return ImageLayout(placeholder=context, token=context,
                           prefix=(tokens.get("start_image_token", "<img>"),),
                           suffix=(tokens.get("end_image_token", "</img>"),))

    def model_sizes(self, config: dict, name: str) -> ModelConfig:
        """The unit: one 448-px tile, ``(image / patch · downsample_ratio)²`` tokens."""
        vision = config["vision_config"]
        hidden = vision["hidden_size"]
        vit = VisionConfig(image_size=_first(vision["image_size"]),
                           patch_size=_first(vision["patch_size"]), hidden=hidden,
                           layers=vision["num_hidden_layers"], heads=vision["num_attention_heads"],
                           mlp_ratio=vision["intermediate_size"] / hidden,
                           qkv_bias=bool(vision.get("attention_bias", False)), layer_scale=True,
                           cls_token=True, rms_norm=vision.get("norm_type") == "rms_norm",
                           final_norm=not vision.get("use_mean_pooling", True))
        llm = (config.get("text_config") or {}).get("model_type", "qwen2")
        if llm not in LLM_FEATURES:
            raise ConfigError(f"{name}: an InternVL whose LLM is {llm!r} has features this "
                              f"family does not know (it knows {', '.join(LLM_FEATURES)}); add "
                              "them to LLM_FEATURES in vlmshard/families/internvl.py")
        model = ModelConfig(name=name, vision=vit,
                            llm=LLMConfig.from_hf_config(config, LLM_FEATURES[llm]),
                            downsample_ratio=float(config.get("downsample_ratio", 0.5)))
        model.validate()
        return model

    def tiny_folder(self, path: str, model_type: str = "internvl", *, max_patches: int = 6,
                    corpus: list[str] = CORPUS, vocab_size: int = 420, seed: int = 0,
                    init_std: float = 0.2, llm: str = "qwen2",
                    text_sizes: dict | None = None, vision_sizes: dict | None = None) -> str:
        """``llm``: the LLM's model_type, ``qwen2`` (InternVL3) or InternVL3.5's ``qwen3``
        (heads of 16 apart from hidden / heads, q/k norms) or ``qwen3_moe`` (4 experts, 2 a
        token, layer 1 sparse; its checkpoint stores each expert apart, as the hub's do).
        ``text_sizes`` and ``vision_sizes`` override the LLM's and the ViT's config."""
        from transformers import InternVLConfig
        from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (
            GotOcr2ImageProcessorPil,
        )

        os.makedirs(path, exist_ok=True)
        named = {"start_image_token": "<img>", "end_image_token": "</img>",
                 "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
        vocab = save_tokenizer(path, TOKENS, TEMPLATE, named, corpus, vocab_size)
        config = InternVLConfig(
            text_config={"model_type": llm, "vocab_size": vocab, "hidden_size": 32,
                         "intermediate_size": 64, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, **LLM_EXTRAS[llm],
                         **(text_sizes or {})},
            vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                           "num_attention_heads": 2, "image_size": [448, 448],
                           "patch_size": [14, 14], **(vision_sizes or {})},
            image_token_id=vocab - 2, downsample_ratio=0.5)
        config.save_pretrained(path)
        GotOcr2ImageProcessorPil(crop_to_patches=True, min_patches=1, max_patches=max_patches,
                                 size={"height": 448, "width": 448},
                                 image_mean=list(IMAGENET_MEAN),
                                 image_std=list(IMAGENET_STD)).save_pretrained(path)
        with open(os.path.join(path, "processor_config.json"), "w") as f:
            json.dump({"image_seq_length": 256, "processor_class": "InternVLProcessor"}, f)
        save_video_config(path, "InternVLVideoProcessor", {
            "size": {"height": 448, "width": 448}, "num_frames": 4, "do_sample_frames": True,
            "initial_shift": True, "image_mean": list(IMAGENET_MEAN),
            "image_std": list(IMAGENET_STD)})
        save_random_weights(path, seed, init_std)
        return path


# The tiny folders' LLM sizes beyond those every InternVL LLM shares
LLM_EXTRAS = {
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "qwen3_moe": {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 24, "decoder_sparse_step": 1, "mlp_only_layers": [0]},
}


def _first(value):
    """``image_size``/``patch_size`` are [h, w] lists in InternVL's vision config."""
    return value[0] if isinstance(value, list) else value


def _tokens_per_tile(config: dict) -> int:
    """(image_size / patch_size · downsample_ratio)², as ``InternVLProcessor`` documents."""
    vision = config.get("vision_config", {})
    image, patch = vision.get("image_size", [448, 448]), vision.get("patch_size", [14, 14])
    return int(_first(image) // _first(patch) * config.get("downsample_ratio", 0.5)) ** 2
