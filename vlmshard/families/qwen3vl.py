"""Qwen3-VL, dense (``qwen3_vl``) and MoE (``qwen3_vl_moe``), as ``transformers`` models them.

Images go through the very processor Qwen2-VL uses (``Qwen2VLImageProcessor``: ``smart_resize``
to multiples of patch·merge pixels, flattened patches, each frame repeated ``temporal_patch_size``
times), with Qwen3-VL's published settings: 16-px patches (a 32-px merged patch is one tile and
one LLM token), mean/std 0.5, and its pixel limits as ``size.shortest_edge`` /
``size.longest_edge``. Its ``get_rope_index`` numbers an image's tokens as Qwen2-VL's does, so
tiling, layout and position ids are the Qwen2-VL family's; what differs is the chat template
(no default system turn), the model (a learned position table interpolated per image, DeepStack
mergers feeding the first LLM layers, q/k norms, an explicit ``head_dim``, sparse MoE blocks in
``qwen3_vl_moe``) and so the cost model and the trainer's layer map.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import ClassVar

import numpy as np

from vlmshard.model_sizes import LLMConfig, LLMFeatures, ModelConfig, VisionConfig

from .base import ImageLayout, SampledVideo
from .folder import ModelFolder
from .qwen2vl import TOKENS, Qwen2VL, Qwen2VLTiling
from .tiny import (
    CHAT_TOKENS,
    CORPUS,
    save_random_weights,
    save_tokenizer,
    save_video_config,
)

QWEN3_MEAN = QWEN3_STD = (0.5, 0.5, 0.5)

# Qwen3's attention: q/k norms (biases as config.json's ``attention_bias`` says).
LLM_FEATURES = LLMFeatures(qk_norm=True)

# Qwen3-VL's ViT (every size of the family): 27 blocks, 16-px patches, a 48×48 learned
# position table, DeepStack after blocks 8, 16, 24. The unit: a 32-px merged patch.
VIT = VisionConfig(image_size=32, patch_size=16, hidden=1152, layers=27, heads=16,
                   mlp_ratio=4304 / 1152, position_embeddings=2304, temporal_patch=2,
                   deepstack=(8, 16, 24), fused_qkv=True)

PRESETS = {
    # Qwen3-VL-8B-Instruct's config.json: its ViT + Qwen3-8B (head_dim 128, q/k norms).
    "qwen3-vl-8b": ModelConfig(
        name="qwen3-vl-8b",
        vision=VIT,
        llm=LLMConfig(vocab_size=151936, hidden=4096, layers=36, heads=32, kv_heads=8,
                      intermediate=12288, rope_theta=5e6, head_dim=128, **asdict(LLM_FEATURES)),
        downsample_ratio=0.5, projector="merger"),
    # Qwen3-VL-30B-A3B-Instruct's config.json: its ViT + Qwen3-30B-A3B (48 MoE layers of
    # 128 experts, 8 a token): about 31B parameters held, 3B active per token.
    "qwen3-vl-30b-a3b": ModelConfig(
        name="qwen3-vl-30b-a3b",
        vision=VIT,
        llm=LLMConfig(vocab_size=151936, hidden=2048, layers=48, heads=32, kv_heads=4,
                      intermediate=6144, rope_theta=5e6, head_dim=128,
                      experts=128, experts_per_token=8, moe_intermediate=768,
                      **asdict(LLM_FEATURES)),
        downsample_ratio=0.5, projector="merger"),
}


@dataclass(frozen=True)
class Qwen3VLTiling(Qwen2VLTiling):
    """Qwen3-VL's processing: images as Qwen2-VL's; videos as ``Qwen3VLVideoProcessor`` samples
    and resizes them (``sample_video``), with its defaults."""

    video_min_pixels: int = 128 * 32 * 32
    video_max_pixels: int = 32 * 32 * 768  # over all frames: t·h·w (published: 25,165,824)
    cap_pixels_per_frame: bool = False  # transformers' default (None: no per-frame cap)
    max_video_tokens: int = 768  # the per-frame token ceiling, with cap_pixels_per_frame
    name: ClassVar[str] = "qwen3vl"

    def sample_video(self, frames: int, fps: float, width: int, height: int,
                     given: bool = False) -> SampledVideo:
        """``Qwen3VLVideoProcessor.sample_frames`` at ``fps`` (``linspace`` over the clip,
        rounded: first and last frame), its ``smart_resize`` over all the frames' pixels
        (``t·h·w`` within the video size; a frame list too), the last frame repeated to a whole
        temporal patch, and each temporal step's time (the mean of its frames' index / fps), as
        its processor writes it in the text. ``given``: a frame list, all kept."""
        t, f = self.temporal_patch_size, self.tile_size
        if given:
            n, indices = frames, list(range(frames))
        else:
            n = min(max(int(frames / fps * self.fps), self.min_frames), self.max_frames, frames)
            indices = np.linspace(0, frames - 1, n).round().astype(int).tolist()
        max_pixels = self.video_max_pixels
        if self.cap_pixels_per_frame:
            per_frame = max(min(self.max_video_tokens * f * f, self.video_max_pixels // n),
                            int(self.video_min_pixels * 1.05))
            max_pixels = per_frame * n
        h, w = self.resized(width, height, self.video_min_pixels, max_pixels, frames=max(n, t))
        indices += indices[-1:] * (-len(indices) % t)
        grid = (len(indices) // t, h // self.patch_size, w // self.patch_size)
        tokens = grid[0] * grid[1] * grid[2] // self.merge_size ** 2
        seconds = [i / fps for i in indices]
        steps = tuple((seconds[k] + seconds[k + t - 1]) / 2 for k in range(0, len(seconds), t))
        return SampledVideo(indices=tuple(indices), width=w, height=h, grid=grid, tiles=tokens,
                            tokens=tokens, seconds_per_step=t * frames / (n * fps) if not given
                            else t / fps, fps=fps, timestamps=steps)


# Qwen3-VL-Instruct's published template (Qwen3-VL-30B-A3B-Instruct's chat_template.json) for
# images, videos, text and tools: a system turn only when the conversation has one or tools are
# given; text items rendered as written; an assistant's tool calls after its content, each
# ``<tool_call>`` JSON; tool results as ``<tool_response>`` blocks of one user turn.
_SYSTEM_TEXT = ("{%- if messages[0].content is string %}{{- messages[0].content }}"
                "{%- else %}{%- for content in messages[0].content %}"
                "{%- if 'text' in content %}{{- content.text }}{%- endif %}{%- endfor %}"
                "{%- endif %}")
_ITEMS = ("{%- for content in message.content %}"
          "{%- if content.type == 'image' or 'image' in content or 'image_url' in content %}"
          "{%- set image_count.value = image_count.value + 1 %}"
          "{%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}"
          "<|vision_start|><|image_pad|><|vision_end|>"
          "{%- elif content.type == 'video' or 'video' in content %}"
          "{%- set video_count.value = video_count.value + 1 %}"
          "{%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}"
          "<|vision_start|><|video_pad|><|vision_end|>"
          "{%- elif 'text' in content %}{{- content.text }}{%- endif %}{%- endfor %}")
TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}" + _SYSTEM_TEXT + "{{- '\\n\\n' }}{%- endif %}"
    "{{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n"
    "</tool_call><|im_end|>\\n\" }}"
    "{%- else %}{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' }}"
    + _SYSTEM_TEXT + "{{- '<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- set image_count = namespace(value=0) %}"
    "{%- set video_count = namespace(value=0) %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}" + _ITEMS + "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for content_item in message.content %}"
    "{%- if 'text' in content_item %}{{- content_item.text }}{%- endif %}{%- endfor %}"
    "{%- endif %}"
    "{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}"
    "{%- if (loop.first and message.content) or (not loop.first) %}{{- '\\n' }}{%- endif %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}" + _ITEMS + "{%- endif %}"
    "{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


class Qwen3VL(Qwen2VL):
    name = "qwen3vl"
    model_types = ("qwen3_vl", "qwen3_vl_moe")
    presets = PRESETS
    default_preset = "qwen3-vl-8b"
    llm_features = LLM_FEATURES
    trainer_layers = "vlmshard.train.models.qwen3vl:layers"
    description = "Qwen3-VL, Qwen3-VL-MoE"
    demo_limits = {"max_pixels": 32 * 32 * 256}  # up to 256 merged patches an image
    # Qwen3-VL's preprocessor_config.json: 256² to 4096² pixels
    policies = (Qwen3VLTiling,)
    defaults = Qwen3VLTiling(mean=QWEN3_MEAN, std=QWEN3_STD, patch_size=16,
                             min_pixels=65536, max_pixels=16777216)
    template: ClassVar[str] = TEMPLATE  # the tiny folders' chat template
    plain_tokens: ClassVar[tuple[str, ...]] = ()  # their added tokens that are not special

    def video_layout(self, folder: ModelFolder) -> ImageLayout:
        """Each temporal step is its own ``<|vision_start|>…<|vision_end|>`` after its time:
        the template's wrapper around the placeholder is replaced, as Qwen's own processor
        (``transformers`` 4.57, which its fine-tuning code pins; vLLM) does. ``transformers``
        5.23 leaves the template's pair around them too (``docs/video.md``)."""
        tokens = folder.special_tokens()
        token = tokens.get("video_token", "<|video_pad|>")
        start = tokens.get("vision_start_token", "<|vision_start|>")
        end = tokens.get("vision_end_token", "<|vision_end|>")
        return ImageLayout(placeholder=token, token=token, prefix=(start,), suffix=(end,),
                           replaces=(start, end))

    def video_pieces(self, video: SampledVideo, layout: ImageLayout) -> list[str | int]:
        """``<t.t seconds>`` and the step's tokens, per temporal step."""
        per_step = video.tokens // video.grid[0]
        pieces: list[str | int] = []
        for seconds in video.timestamps:
            pieces += [f"<{seconds:.1f} seconds>", per_step]
        return pieces

    def position_ids(self, input_ids: np.ndarray, visual_ids: tuple[int, ...],
                     grids: list[tuple[int, int, int]], policy: Qwen2VLTiling,
                     steps: list[float] | None = None) -> np.ndarray:
        """As Qwen2-VL's, with each temporal step of a video its own [1, h, w] grid (its time
        is in the text): ``get_rope_index`` splits ``video_grid_thw`` so."""
        frames = [(1, h, w) for t, h, w in grids for _ in range(t)]
        return super().position_ids(input_ids, visual_ids, frames, policy)

    def vision_extras(self, vision: dict) -> dict:
        """Its learned position table and DeepStack mergers (each the merger's size, after the
        block it reads)."""
        return {"position_embeddings": vision.get("num_position_embeddings", 0),
                "deepstack": tuple(vision.get("deepstack_visual_indexes", ()))}

    def tiny_text(self, model_type: str) -> dict:
        """The tiny LLM's sizes beyond the dense Qwen3 ones all share."""
        if model_type == "qwen3_vl_moe":  # 4 experts, 2 a token, layers 1 to 3 of 4 sparse;
            # trained with the router's auxiliary loss, weighed so that it shows in the loss
            return dict(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=24, decoder_sparse_step=1, mlp_only_layers=[0],
                        output_router_logits=True, router_aux_loss_coef=0.05)
        return {}

    def tiny_vision(self) -> dict:
        """The tiny ViT's settings beyond the sizes all share: DeepStack after blocks 0 and 1."""
        return dict(deepstack_visual_indexes=[0, 1])

    def tiny_folder(self, path: str, model_type: str = "qwen3_vl", *,
                    min_pixels: int = 64 * 64, max_pixels: int = 32 * 32 * 64,
                    corpus: list[str] = CORPUS, vocab_size: int = 420, seed: int = 0,
                    init_std: float = 0.2, text_sizes: dict | None = None,
                    vision_sizes: dict | None = None, weights_dtype: str = "float32",
                    tie_word_embeddings: bool = False) -> str:
        """Three ViT blocks, DeepStack from blocks 0 and 1 into LLM layers 0 and 1 of three
        (of four for MoE); LLM heads of 16 (not hidden / heads), as Qwen3 sets ``head_dim``
        apart. ``text_sizes`` and ``vision_sizes`` override the configs' sizes (a benchmark's
        published model with random weights; its embedding may exceed the tokenizer);
        ``tie_word_embeddings``: the LM head is the token embedding (Qwen3-VL-2B's and 4B's)."""
        from transformers import AutoConfig
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        os.makedirs(path, exist_ok=True)
        vocab = save_tokenizer(path, TOKENS, self.template, {"image_token": "<|image_pad|>",
                                                             "video_token": "<|video_pad|>"},
                               corpus, vocab_size, self.plain_tokens)
        ids = {t: i for i, t in enumerate(CHAT_TOKENS)}
        text = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                     "mrope_section": [4, 2, 2], "mrope_interleaved": True},
                    bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
        text.update(self.tiny_text(model_type))
        text.update(text_sizes or {})
        vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2,
                      out_hidden_size=32, patch_size=16, spatial_merge_size=2,
                      temporal_patch_size=2, num_position_embeddings=16,
                      **self.tiny_vision())
        vision.update(vision_sizes or {})
        config = AutoConfig.for_model(
            model_type, text_config=text, vision_config=vision,
            image_token_id=vocab - 2, video_token_id=vocab - 1,
            vision_start_token_id=vocab - 4, vision_end_token_id=vocab - 3,
            tie_word_embeddings=tie_word_embeddings)
        config.save_pretrained(path)
        Qwen2VLImageProcessorPil(patch_size=16, image_mean=list(QWEN3_MEAN),
                                 image_std=list(QWEN3_STD), min_pixels=min_pixels,
                                 max_pixels=max_pixels).save_pretrained(path)
        save_video_config(path, "Qwen3VLVideoProcessor", {  # a budget of four frames' pixels
            "size": {"shortest_edge": min_pixels, "longest_edge": 4 * max_pixels}, "fps": 2.0,
            "min_frames": 4, "max_frames": 768, "do_sample_frames": True, "patch_size": 16,
            "temporal_patch_size": 2, "merge_size": 2, "image_mean": list(QWEN3_MEAN),
            "image_std": list(QWEN3_STD)})
        save_random_weights(path, seed, init_std, weights_dtype)
        return path
