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
from typing import ClassVar

from .qwen2vl import TOKENS, Qwen2VL, Qwen2VLTiling
from .tiny import CHAT_TOKENS, CORPUS, save_random_weights, save_tokenizer

QWEN3_MEAN = QWEN3_STD = (0.5, 0.5, 0.5)

# Qwen3-VL-Instruct's published template for images and text (its tool and video branches left
# out): a system turn only when the conversation has one; text items rendered as written.
TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].content is string %}{{- messages[0].content }}"
    "{%- else %}{%- for content in messages[0].content %}"
    "{%- if 'text' in content %}{{- content.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- set image_count = namespace(value=0) %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for content in message.content %}"
    "{%- if content.type == 'image' or 'image' in content or 'image_url' in content %}"
    "{%- set image_count.value = image_count.value + 1 %}"
    "{%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif 'text' in content %}{{- content.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for content_item in message.content %}"
    "{%- if 'text' in content_item %}{{- content_item.text }}{%- endif %}{%- endfor %}"
    "{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


class Qwen3VL(Qwen2VL):
    name = "qwen3vl"
    model_types = ("qwen3_vl", "qwen3_vl_moe")
    default_preset = "qwen3-vl-8b"
    trainer_layers = "vlmshard.train.models.qwen3vl:layers"
    description = "Qwen3-VL, Qwen3-VL-MoE"
    demo_limits = {"max_pixels": 32 * 32 * 256}  # up to 256 merged patches an image
    # Qwen3-VL's preprocessor_config.json: 256² to 4096² pixels
    defaults = Qwen2VLTiling(mean=QWEN3_MEAN, std=QWEN3_STD, patch_size=16,
                             min_pixels=65536, max_pixels=16777216)
    template: ClassVar[str] = TEMPLATE  # the tiny folders' chat template
    plain_tokens: ClassVar[tuple[str, ...]] = ()  # their added tokens that are not special

    def video_layout(self, folder) -> None:
        """Qwen3-VL's videos (a timestamp text per temporal step) are not built yet."""
        return None

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
                    vision_sizes: dict | None = None, weights_dtype: str = "float32") -> str:
        """Three ViT blocks, DeepStack from blocks 0 and 1 into LLM layers 0 and 1 of three
        (of four for MoE); LLM heads of 16 (not hidden / heads), as Qwen3 sets ``head_dim``
        apart. ``text_sizes`` and ``vision_sizes`` override the configs' sizes (a benchmark's
        published model with random weights; its embedding may exceed the tokenizer)."""
        from transformers import AutoConfig
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        os.makedirs(path, exist_ok=True)
        vocab = save_tokenizer(path, TOKENS, self.template, {"image_token": "<|image_pad|>"},
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
            tie_word_embeddings=False)
        config.save_pretrained(path)
        Qwen2VLImageProcessorPil(patch_size=16, image_mean=list(QWEN3_MEAN),
                                 image_std=list(QWEN3_STD), min_pixels=min_pixels,
                                 max_pixels=max_pixels).save_pretrained(path)
        save_random_weights(path, seed, init_std, weights_dtype)
        return path
