"""Qwen3.5, dense (``qwen3_5``) and MoE (``qwen3_5_moe``), as ``transformers`` models them.

Its data path is Qwen3-VL's: ``Qwen3VLProcessor`` with ``Qwen2VLImageProcessor`` (16-px
patches, a 32-px merged patch one tile and one LLM token, mean/std 0.5), and ``get_rope_index``
numbers an image's tokens as Qwen2-VL's does; the limits come from the folder's processor
config. What differs is the chat template (thinking blocks) and the model: Qwen3-VL's ViT
without DeepStack, and an LLM whose layers are mostly Gated DeltaNet (linear attention) with a
gated full-attention layer every few (``layer_types``). The trainer keeps packed samples apart in
both kinds (``vlmshard.train.models.linear_attention``); the cost model charges attention's
quadratic term to the full-attention layers only.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import ClassVar

from vlmshard.model_sizes import LLMConfig, LLMFeatures, ModelConfig

from .folder import with_defaults
from .qwen3vl import VIT, Qwen3VL

# Qwen3.5's attention is Qwen3-Next's: q/k norms, its output always gated; its RMSNorms scale
# by (1 + weight)
LLM_FEATURES = LLMFeatures(qk_norm=True, attention_gate=True, offset_norms=True)

PRESETS = {
    # Qwen3.5-9B (its config.json's first lines and model card): Qwen3-VL's ViT without
    # DeepStack + 32 layers, each fourth gated full attention (16 heads of 256, 4 kv heads),
    # the others Gated DeltaNet (16 key and 32 value heads of 128).
    "qwen3.5-9b": ModelConfig(
        name="qwen3.5-9b",
        vision=replace(VIT, deepstack=()),
        llm=LLMConfig(vocab_size=248320, hidden=4096, layers=32, heads=16, kv_heads=4,
                      intermediate=12288, rope_theta=1e7, head_dim=256,
                      linear_layers=tuple(i for i in range(32) if (i + 1) % 4),
                      linear_key_heads=16, linear_value_heads=32, linear_key_dim=128,
                      linear_value_dim=128, **asdict(LLM_FEATURES)),
        downsample_ratio=0.5, projector="merger"),
}

# Qwen3.5's published chat template (Qwen3.5-4B and larger, thinking on by default; as
# huggingface/trl keeps it byte for byte in trl/chat_templates/qwen3_5_think.jinja) for images,
# videos and text, its tool branches left out: no default system turn; each message's content
# trimmed; an assistant turn after the last user turn opens with a think block (empty when it
# has no reasoning), earlier ones lose theirs.
TEMPLATE = (
    "{%- set image_count = namespace(value=0) %}"
    "{%- set video_count = namespace(value=0) %}"
    "{%- macro render_content(content, do_vision_count, is_system_content=false) %}"
    "{%- if content is string %}{{- content }}"
    "{%- elif content is iterable and content is not mapping %}{%- for item in content %}"
    "{%- if 'image' in item or 'image_url' in item or item.type == 'image' %}"
    "{%- if is_system_content %}{{- raise_exception('System message cannot contain images.') }}"
    "{%- endif %}"
    "{%- if do_vision_count %}{%- set image_count.value = image_count.value + 1 %}{%- endif %}"
    "{%- if add_vision_id %}{{- 'Picture ' ~ image_count.value ~ ': ' }}{%- endif %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif 'video' in item or item.type == 'video' %}"
    "{%- if is_system_content %}{{- raise_exception('System message cannot contain videos.') }}"
    "{%- endif %}"
    "{%- if do_vision_count %}{%- set video_count.value = video_count.value + 1 %}{%- endif %}"
    "{%- if add_vision_id %}{{- 'Video ' ~ video_count.value ~ ': ' }}{%- endif %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in item %}{{- item.text }}"
    "{%- else %}{{- raise_exception('Unexpected item type in content.') }}{%- endif %}"
    "{%- endfor %}"
    "{%- elif content is none or content is undefined %}{{- '' }}"
    "{%- else %}{{- raise_exception('Unexpected content type.') }}{%- endif %}"
    "{%- endmacro %}"
    "{%- if not messages %}{{- raise_exception('No messages provided.') }}{%- endif %}"
    "{%- if messages[0].role == 'system' %}"
    "{%- set content = render_content(messages[0].content, false, true)|trim %}"
    "{{- '<|im_start|>system\n' + content + '<|im_end|>\n' }}{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}"
    "{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' %}"
    "{%- set content = render_content(message.content, false)|trim %}"
    "{%- if not(content.startswith('<tool_response>') and content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if ns.multi_step_tool %}{{- raise_exception('No user query found in messages.') }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- set content = render_content(message.content, true)|trim %}"
    "{%- if message.role == 'system' %}"
    "{%- if not loop.first %}{{- raise_exception('System message must be at the beginning.') }}"
    "{%- endif %}"
    "{%- elif message.role == 'user' %}"
    "{{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}"
    "{%- set reasoning_content = message.reasoning_content %}"
    "{%- else %}{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\n')"
    ".split('<think>')[-1].lstrip('\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{%- endif %}{%- endif %}"
    "{%- set reasoning_content = reasoning_content|trim %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content + '\n</think>\n\n'"
    " + content }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\n' }}"
    "{%- else %}{{- raise_exception('Unexpected message role.') }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\n\n</think>\n\n' }}{%- else %}{{- '<think>\n' }}{%- endif %}"
    "{%- endif %}")


class Qwen3_5(Qwen3VL):
    name = "qwen3_5"
    model_types = ("qwen3_5", "qwen3_5_moe")
    presets = PRESETS
    default_preset = "qwen3.5-9b"
    llm_features = LLM_FEATURES
    trainer_layers = "vlmshard.train.models.qwen3vl:layers"
    description = "Qwen3.5, Qwen3.5-MoE"
    template: ClassVar[str] = TEMPLATE
    plain_tokens = ("<think>", "</think>")  # added tokens, not special, as in Qwen's vocabulary

    def model_sizes(self, config: dict, name: str):
        """As Qwen3-VL's, read with ``transformers``' defaults (the layer kinds may be stated
        by ``full_attention_interval`` alone)."""
        return super().model_sizes(with_defaults(config, name), name)

    def tiny_text(self, model_type: str) -> dict:
        """Four layers: three Gated DeltaNet, then full attention (Qwen3.5's own 3:1 pattern);
        linear attention with more value heads than key heads, as Qwen3.5's; a partial rotary
        of half of each head. MoE: 4 experts, 2 a token, and a shared expert in every layer,
        trained with the router's auxiliary loss weighed so that it shows in the loss."""
        text = dict(num_hidden_layers=4, full_attention_interval=4,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                    linear_value_head_dim=8, linear_conv_kernel_dim=4,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                     "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
                                     "mrope_interleaved": True})
        if model_type == "qwen3_5_moe":
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                        shared_expert_intermediate_size=16, output_router_logits=True,
                        router_aux_loss_coef=0.05)
        return text

    def tiny_vision(self) -> dict:
        return {}  # no DeepStack
