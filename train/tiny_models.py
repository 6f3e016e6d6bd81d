"""Tiny, offline Hugging Face model folders of each family, built the way the hub's are: the demo
model and the tests' models.

A byte-level BPE trained here on a few sentences (so any text encodes) with the family's special
tokens, saved by ``transformers``; a chat template in the family's format (Qwen2-VL's, with its
default system prompt; transformers' InternVL one); a ``transformers`` config with small sizes;
the image processor config saved by ``transformers``' own (PIL) image processor class, with small
limits so test images make several tiles; and random weights saved with ``save_pretrained``
(``init_std``: a larger spread than the default 0.02 makes the output depend visibly on every
input, so a wrong position or a missing image changes the loss).
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
                   vocab_size: int = 420, seed: int = 0, init_std: float = 0.2) -> str:
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    os.makedirs(path, exist_ok=True)
    vocab = _save_tokenizer(path, QWEN2VL_TOKENS, QWEN2VL_TEMPLATE,
                            {"image_token": "<|image_pad|>"}, corpus, vocab_size)
    ids = {t: i for i, t in enumerate(CHAT_TOKENS)}
    if model_type == "qwen2_vl":
        config_class = Qwen2VLConfig
        vision = dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2)
    elif model_type == "qwen2_5_vl":  # windowed ViT: 4x4 merged patches, block 1 full
        config_class = Qwen2_5_VLConfig
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                      out_hidden_size=32, window_size=112, fullatt_block_indexes=[1])
    else:
        raise ValueError(f"not a Qwen2-VL model_type: {model_type!r}")
    config = config_class(
        text_config=dict(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]},
                         bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"]),
        vision_config=dict(vision, spatial_merge_size=2, patch_size=14, temporal_patch_size=2),
        image_token_id=vocab - 2, video_token_id=vocab - 1,
        vision_start_token_id=vocab - 4, vision_end_token_id=vocab - 3,
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
    config.save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels).save_pretrained(path)
    save_random_weights(path, seed, init_std)
    return path


def internvl_folder(path: str, *, max_patches: int = 6, corpus: list[str] = CORPUS,
                    vocab_size: int = 420, seed: int = 0, init_std: float = 0.2) -> str:
    from transformers import InternVLConfig
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (
        GotOcr2ImageProcessorPil)

    os.makedirs(path, exist_ok=True)
    named = {"start_image_token": "<img>", "end_image_token": "</img>",
             "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
    vocab = _save_tokenizer(path, INTERNVL_TOKENS, INTERNVL_TEMPLATE, named, corpus, vocab_size)
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
    save_random_weights(path, seed, init_std)
    return path


def save_random_weights(path: str, seed: int, init_std: float) -> None:
    """Random weights for the folder's config, saved as safetensors with ``save_pretrained``."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    for sub in (config, config.get_text_config(), getattr(config, "vision_config", None)):
        if sub is not None and hasattr(sub, "initializer_range"):
            sub.initializer_range = init_std
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    model.save_pretrained(path)



TINY_FAMILIES = ("internvl", "qwen2_vl", "qwen2_5_vl")


def tiny_folder(family: str, path: str) -> str:
    """The demo's model folder: a tokenizer that has seen the demo data's words, InternVL's tile
    limit of 12 (Qwen2-VL: up to 256 merged patches an image), random weights. The same bytes
    every time, so rerunning the demo redoes nothing it need not."""
    from vlmshard.preprocess.demo_data import WORDS

    corpus = CORPUS + [" ".join(WORDS[i:] + WORDS[:i]) for i in range(0, len(WORDS), 7)]
    if family == "internvl":
        return internvl_folder(path, max_patches=12, corpus=corpus, vocab_size=1000)
    if family in TINY_FAMILIES:
        return qwen2vl_folder(path, model_type=family, max_pixels=28 * 28 * 256, corpus=corpus,
                              vocab_size=1000)
    raise ValueError(f"no tiny model of family {family!r}; known: {', '.join(TINY_FAMILIES)}")
