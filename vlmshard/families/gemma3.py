"""Gemma 3 (``gemma3``), as ``transformers`` models it (``Gemma3Processor`` with
``Gemma3ImageProcessor``, ``Gemma3ForConditionalGeneration``).

Each image is resized whole to a square of ``size`` (896 px, bilinear, no aspect kept): one
*tile*, SigLIP's unit of work, which the projector pools to ``image_seq_length`` (256) soft
tokens. The chat template renders ``<start_of_image>`` per image; the processor replaces it by
``"\\n\\n<start_of_image>" + "<image_soft_token>" × 256 + "<end_of_image>\\n\\n"``. With
pan-and-scan on (``do_pan_and_scan``, off in the published config), an image wide or tall
enough is also cut into 2 to ``pan_and_scan_max_num_crops`` crops along its long side, each a
tile of its own, and the processor writes "Here is the original image …" around them.
Position ids run 0..n-1 per sample; in the LLM an image's soft tokens attend to each other both
ways, and most layers attend within a sliding window (``vlmshard.train.models.gemma3``).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from vlmshard.model_sizes import LLMConfig, LLMFeatures, ModelConfig, VisionConfig

from .base import Family, ImageLayout, Normalized, SquareTiles
from .folder import ModelFolder, processor_value, with_defaults
from .tiny import CORPUS, save_random_weights, save_tokenizer

if TYPE_CHECKING:
    from PIL import Image

GEMMA_MEAN = GEMMA_STD = (0.5, 0.5, 0.5)
BILINEAR = 2  # PIL's filter number, as preprocessor_config.json writes ``resample``
CROPS_TEXT = ("Here is the original image ", " and here are some crops to help you see better ",
              " ")  # Gemma3Processor.replace_image_token, around an image and its crops


@dataclass(frozen=True)
class Gemma3Tiling(SquareTiles, Normalized):
    """``Gemma3ImageProcessor``: the image resized to a square, and with pan-and-scan its
    crops, each resized the same way."""

    mean: tuple[float, float, float] = GEMMA_MEAN
    std: tuple[float, float, float] = GEMMA_STD
    resample: int = BILINEAR
    image_size: int = 896
    tokens_per_tile: int = 256
    pan_and_scan: bool = False
    min_crop_size: int = 256
    max_crops: int = 4
    min_ratio: float = 1.2
    name: ClassVar[str] = "gemma3"

    def crops(self, width: int, height: int) -> tuple[int, int, int, int]:
        """(columns, rows, crop width, crop height) as ``Gemma3ImageProcessor.pan_and_scan``
        cuts the image, or all 0 when it does not."""
        if not self.pan_and_scan:
            return 0, 0, 0, 0
        long, short = max(width, height), min(width, height)
        if long / short < self.min_ratio:
            return 0, 0, 0, 0
        n = min(int(math.floor(long / short + 0.5)), int(math.floor(long / self.min_crop_size)))
        n = min(self.max_crops, max(2, n))
        cols, rows = (n, 1) if width >= height else (1, n)
        crop_w, crop_h = math.ceil(width / cols), math.ceil(height / rows)
        if min(crop_w, crop_h) < self.min_crop_size:
            return 0, 0, 0, 0
        return cols, rows, crop_w, crop_h

    def tiles(self, width: int, height: int, n_images: int) -> int:
        cols, rows, _, _ = self.crops(width, height)
        return 1 + cols * rows

    def pixels(self, image: "Image.Image", n_images: int) -> np.ndarray:
        """[tiles, 3, S, S]: the whole image, then its crops row-major (a crop past the edge
        stops at it, as the processor's array slice does)."""
        size = self.image_size
        cols, rows, crop_w, crop_h = self.crops(image.width, image.height)
        parts = [image] + [image.crop((c * crop_w, r * crop_h,
                                       min((c + 1) * crop_w, image.width),
                                       min((r + 1) * crop_h, image.height)))
                           for r in range(rows) for c in range(cols)]
        return self.normalize(np.stack([self.resize(p, size, size) for p in parts]))


# Gemma 3's published chat template (google/gemma-3-*-it; as huggingface/trl keeps it byte for
# byte in trl/chat_templates/gemma3.jinja): the system turn folded into the first user turn,
# each text item trimmed, the assistant's role named "model".
TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate "
    "user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n")
CHAT = {"pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>",
        "start_of_turn": "<start_of_turn>", "end_of_turn": "<end_of_turn>"}
NAMED = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
         "image_token": "<image_soft_token>"}


# Gemma 3's layers: q/k norms, norms after attention and after the MLP too, RMSNorms scaling by
# (1 + weight)
LLM_FEATURES = LLMFeatures(qk_norm=True, sandwich_norms=True, offset_norms=True)

PRESETS = {
    # Gemma 3 4B (gemma-3-4b-it's config.json, the rest transformers' Gemma3TextConfig
    # defaults): SigLIP-400M at 896 px pooled to 256 tokens + 34 layers, each sixth global, the
    # others local in a window of 1024. The ViT unit: one 896-px image (or crop).
    "gemma-3-4b": ModelConfig(
        name="gemma-3-4b",
        vision=VisionConfig(image_size=896, patch_size=14, hidden=1152, layers=27, heads=16,
                            mlp_ratio=4304 / 1152),
        llm=LLMConfig(vocab_size=262208, hidden=2560, layers=34, heads=8, kv_heads=4,
                      intermediate=10240, head_dim=256, sliding_window=1024,
                      sliding_layers=tuple(i for i in range(34) if (i + 1) % 6),
                      tied_embeddings=True, **asdict(LLM_FEATURES)),
        downsample_ratio=0.25, projector="pool"),
}


class Gemma3(Family):
    name = "gemma3"
    model_types = ("gemma3",)
    policies = (Gemma3Tiling,)
    presets = PRESETS
    default_preset = "gemma-3-4b"
    trainer_layers = "vlmshard.train.models.gemma3:layers"
    description = "Gemma 3"
    bidirectional_images = True
    demo_limits = {"image_size": 64}

    def tiling(self, folder: ModelFolder) -> Gemma3Tiling:
        d = Gemma3Tiling()
        size = processor_value(folder, "size", None) or {"height": 224}
        return Gemma3Tiling(
            image_size=int(size["height"]),
            tokens_per_tile=int(processor_value(folder, "image_seq_length",
                                                folder.config.get("mm_tokens_per_image", 256))),
            pan_and_scan=bool(processor_value(folder, "do_pan_and_scan", False)),
            min_crop_size=int(processor_value(folder, "pan_and_scan_min_crop_size",
                                              d.min_crop_size)),
            max_crops=int(processor_value(folder, "pan_and_scan_max_num_crops", d.max_crops)),
            min_ratio=float(processor_value(folder, "pan_and_scan_min_ratio_to_activate",
                                            d.min_ratio)),
            mean=tuple(processor_value(folder, "image_mean", d.mean)),
            std=tuple(processor_value(folder, "image_std", d.std)),
            resample=int(processor_value(folder, "resample", d.resample)),
            rescale_factor=float(processor_value(folder, "rescale_factor", d.rescale_factor)))

    def layout(self, folder: ModelFolder) -> ImageLayout:
        named = {**NAMED, **folder.special_tokens()}
        tiling = self.tiling(folder)
        return ImageLayout(placeholder=named["boi_token"], token=named["image_token"],
                           prefix=(named["boi_token"],), suffix=(named["eoi_token"],),
                           around=("\n\n", "\n\n"),
                           tile_tokens=tiling.tokens_per_tile if tiling.pan_and_scan else 0,
                           crops=CROPS_TEXT)

    def model_sizes(self, config: dict, name: str) -> ModelConfig:
        """The unit: one image (or crop) of ``image_size`` px, ``mm_tokens_per_image`` tokens
        after the projector's pooling."""
        config = with_defaults(config, name)
        vision = config["vision_config"]
        hidden = vision["hidden_size"]
        side = vision["image_size"] // vision["patch_size"]
        tokens = config.get("mm_tokens_per_image", 256)
        vit = VisionConfig(image_size=vision["image_size"], patch_size=vision["patch_size"],
                           hidden=hidden, layers=vision["num_hidden_layers"],
                           heads=vision["num_attention_heads"],
                           mlp_ratio=vision["intermediate_size"] / hidden)
        model = ModelConfig(name=name, vision=vit,
                            llm=LLMConfig.from_hf_config(config, LLM_FEATURES),
                            downsample_ratio=math.isqrt(tokens) / side, projector="pool")
        model.validate()
        return model

    def tiny_folder(self, path: str, model_type: str = "gemma3", *, image_size: int = 64,
                    pan_and_scan: bool = False, corpus: list[str] = CORPUS,
                    vocab_size: int = 420, seed: int = 0, init_std: float = 0.2) -> str:
        """SigLIP of two layers on 64-px images in 16-px patches, pooled 2×2 to 4 soft tokens;
        an LLM of three layers, local (a window of 8) / global / local, heads of 16."""
        from transformers import AutoConfig
        from transformers.models.gemma3.image_processing_pil_gemma3 import (
            Gemma3ImageProcessorPil,
        )

        os.makedirs(path, exist_ok=True)
        vocab = save_tokenizer(path, list(NAMED.values()), TEMPLATE, NAMED, corpus, vocab_size,
                               chat=CHAT)
        ids = {t: i for i, t in enumerate(CHAT.values())}
        config = AutoConfig.for_model(
            model_type,
            text_config=dict(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                             layer_types=["sliding_attention", "full_attention",
                                          "sliding_attention"],
                             pad_token_id=ids["<pad>"], bos_token_id=ids["<bos>"],
                             eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]]),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, image_size=image_size, patch_size=16,
                               vision_use_head=False),
            mm_tokens_per_image=4, boi_token_index=vocab - 3, eoi_token_index=vocab - 2,
            image_token_index=vocab - 1, pad_token_id=ids["<pad>"],
            bos_token_id=ids["<bos>"], eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]])
        config.save_pretrained(path)
        Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size},
                                image_mean=list(GEMMA_MEAN), image_std=list(GEMMA_STD),
                                resample=BILINEAR, do_pan_and_scan=pan_and_scan,
                                pan_and_scan_min_crop_size=32, pan_and_scan_max_num_crops=4,
                                pan_and_scan_min_ratio_to_activate=1.2).save_pretrained(path)
        with open(os.path.join(path, "processor_config.json"), "w") as f:
            f.write('{"image_seq_length": 4, "processor_class": "Gemma3Processor"}\n')
        save_random_weights(path, seed, init_std,
                            randomize=("model.multi_modal_projector.mm_input_projection_weight",))
        return path
