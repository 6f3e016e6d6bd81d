"""Tiny, offline Hugging Face model folders of each family, built the way the hub's are.

A byte-level BPE trained here on a few sentences (so any text encodes) with the family's special
tokens, saved by ``transformers``; a chat template written for the test in the family's format
(Qwen2-VL's, with its default system prompt; transformers' InternVL one); a ``transformers``
config with small sizes; and the image processor config saved by ``transformers``' own (PIL)
image processor class, with small limits so test images make several tiles.
"""

from __future__ import annotations

import json
import os

CORPUS = ["What is in the image? A photo of a cat sitting on the mat.",
          "Describe both pictures. The first shows a rocket, the second an astronaut.",
          "You are a helpful assistant. Answer briefly and precisely, please."] * 20

# Qwen2-VL-Instruct's template (images and text items, default system prompt), without video.
QWEN2VL_TEMPLATE = (
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
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# transformers' InternVL (-hf checkpoints) template: '<IMG_CONTEXT>\n' per image.
INTERNVL_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{'<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}")

CHAT_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN2VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
INTERNVL_TOKENS = ["<img>", "</img>", "<IMG_CONTEXT>", "<video>"]


def _tokenizer(special: list[str], corpus: list[str], vocab_size: int):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=CHAT_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tok


def _save_tokenizer(path: str, special: list[str], template: str, named: dict[str, str],
                    corpus: list[str], vocab_size: int) -> int:
    """Save tokenizer.json + tokenizer_config.json (the template inside it, as hub folders
    have it) + special_tokens_map.json; returns the vocabulary size."""
    from transformers import PreTrainedTokenizerFast

    tok = _tokenizer(special, corpus, vocab_size)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>", **named)
    hf.save_pretrained(path)
    config_path = os.path.join(path, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["chat_template"] = template
    with open(config_path, "w") as f:
        json.dump(config, f, indent=1)
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.exists(jinja):
        os.unlink(jinja)
    with open(os.path.join(path, "special_tokens_map.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, f)
    return tok.get_vocab_size()


def qwen2vl_folder(path: str, *, model_type: str = "qwen2_vl", min_pixels: int = 56 * 56,
                   max_pixels: int = 28 * 28 * 64, corpus: list[str] = CORPUS,
                   vocab_size: int = 420) -> str:
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    os.makedirs(path, exist_ok=True)
    vocab = _save_tokenizer(path, QWEN2VL_TOKENS, QWEN2VL_TEMPLATE,
                            {"image_token": "<|image_pad|>"}, corpus, vocab_size)
    ids = {t: i for i, t in enumerate(CHAT_TOKENS)}
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]},
                         bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"]),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2,
                           spatial_merge_size=2, patch_size=14, temporal_patch_size=2),
        image_token_id=vocab - 2, video_token_id=vocab - 1,
        vision_start_token_id=vocab - 4, vision_end_token_id=vocab - 3,
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
    config.model_type = model_type
    config.save_pretrained(path)
    if model_type != "qwen2_vl":  # a Qwen2.5-VL folder: same processor, its own model_type
        _edit_json(os.path.join(path, "config.json"), model_type=model_type)
    Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels).save_pretrained(path)
    return path


def internvl_folder(path: str, *, max_patches: int = 6) -> str:
    from transformers import InternVLConfig
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (
        GotOcr2ImageProcessorPil)

    os.makedirs(path, exist_ok=True)
    named = {"start_image_token": "<img>", "end_image_token": "</img>",
             "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
    vocab = _save_tokenizer(path, INTERNVL_TOKENS, INTERNVL_TEMPLATE, named, CORPUS, 420)
    config = InternVLConfig(
        text_config=dict(model_type="qwen2", vocab_size=vocab, hidden_size=32,
                         intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=[448, 448], patch_size=[14, 14]),
        image_token_id=vocab - 2, downsample_ratio=0.5)
    config.save_pretrained(path)
    GotOcr2ImageProcessorPil(crop_to_patches=True, min_patches=1, max_patches=max_patches,
                             size={"height": 448, "width": 448},
                             image_mean=[0.485, 0.456, 0.406],
                             image_std=[0.229, 0.224, 0.225]).save_pretrained(path)
    with open(os.path.join(path, "processor_config.json"), "w") as f:
        json.dump({"image_seq_length": 256, "processor_class": "InternVLProcessor"}, f)
    return path


def _edit_json(path: str, **changes) -> None:
    with open(path) as f:
        data = json.load(f)
    data.update(changes)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
