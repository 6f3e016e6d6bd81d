"""What the families' tiny offline model folders share (the demo's model and the tests'), each
built the way the hub's are.

A byte-level BPE trained here on a few sentences (so any text encodes) with the family's special
tokens, saved by ``transformers``; the family's chat template (its ``tiny_folder``); a
``transformers`` config with small sizes; the image processor config saved by ``transformers``'
own (PIL) image processor class, with small limits so test images make several tiles; and random
weights saved with ``save_pretrained`` (``init_std``: a larger spread than the default 0.02 makes
the output depend visibly on every input, so a wrong position or a missing image changes the
loss). Building one needs ``transformers`` and torch; importing this module does not.
"""

from __future__ import annotations

import json
import os

CORPUS = ["What is in the image? A photo of a cat sitting on the mat.",
          "Describe both pictures. The first shows a rocket, the second an astronaut.",
          "You are a helpful assistant. Answer briefly and precisely, please."] * 20

# ChatML's special tokens, first in the vocabulary, by role (those ending in _token name the
# tokenizer's own; "im_start" is only a token)
CHATML = {"pad_token": "<|endoftext|>", "im_start": "<|im_start|>", "eos_token": "<|im_end|>"}
CHAT_TOKENS = list(CHATML.values())


def _tokenizer(special: list[str], corpus: list[str], vocab_size: int, plain: list[str],
               chat: list[str]):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=chat,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tok


def save_tokenizer(path: str, special: list[str], template: str, named: dict[str, str],
                   corpus: list[str], vocab_size: int, plain: list[str] = (),
                   chat: dict[str, str] | None = None) -> int:
    """Save tokenizer.json + tokenizer_config.json + chat_template.jinja (the template in its
    own file, where ``transformers`` 5 saves it and a processor reads it from) +
    special_tokens_map.json; returns the vocabulary size. ``plain``: added tokens
    that are not special (Qwen's ``<think>``), numbered before the ``special`` ones, which
    end the vocabulary. ``chat``: the special tokens that begin it, by role (``eos_token``,
    ``pad_token``, ``bos_token``, or a name of its own; default: ChatML's)."""
    from transformers import PreTrainedTokenizerFast

    chat = chat or CHATML
    tok = _tokenizer(special, corpus, vocab_size, list(plain), list(chat.values()))
    roles = {k: v for k, v in chat.items() if k.endswith("_token")}
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, **roles, **named)
    hf.save_pretrained(path)
    with open(os.path.join(path, "special_tokens_map.json"), "w") as f:
        json.dump(roles, f)
    return tok.get_vocab_size()


def save_random_weights(path: str, seed: int, init_std: float,
                        dtype: str = "float32", randomize: tuple[str, ...] = ()) -> None:
    """Random weights for the folder's config, saved in ``dtype`` as safetensors with
    ``save_pretrained``. ``randomize``: parameters the model initializes to zero that would
    stop every gradient behind them (Gemma 3's projection), drawn with ``init_std`` too."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    for sub in (config, config.get_text_config(), getattr(config, "vision_config", None)):
        if sub is not None and hasattr(sub, "initializer_range"):
            sub.initializer_range = init_std
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    with torch.no_grad():
        for name in randomize:
            model.get_parameter(name).normal_(0.0, init_std)
    model.to(getattr(torch, dtype)).save_pretrained(path)




def save_video_config(path: str, processor_type: str, settings: dict) -> None:
    """The folder's ``video_preprocessor_config.json``, written as the video processor class
    saves it (``transformers``' video processors need torchvision, which this torch lacks)."""
    with open(os.path.join(path, "video_preprocessor_config.json"), "w") as f:
        json.dump({"video_processor_type": processor_type, **settings}, f, indent=2,
                  sort_keys=True)
