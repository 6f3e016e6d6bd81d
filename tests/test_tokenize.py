"""The offline demo's encoder (Tekken, mistral template): label masking, image-token expansion,
literal data text, and ids equal to ``mistral-common``'s own Tekkenizer. Model folders' chat
templates are tested in ``test_families.py``."""

import pytest

from vlmshard.preprocess.conversation import text_turn
from vlmshard.preprocess.tokenize import IGNORE_INDEX, TekkenEncoder, tekken_tokenizer


def turns(*pairs):
    return [text_turn(role, text) for role, text in pairs]


@pytest.fixture(scope="module")
def tekken():
    return TekkenEncoder(tekken_tokenizer())


def test_tekken_labels_mask_everything_but_assistant(tekken):
    conversation = turns(("system", "Be brief."), ("user", "<image>\nDescribe the image."),
                         ("assistant", "A cat."), ("user", "And?"), ("assistant", "On a mat."))
    enc = tekken.encode(conversation, [256 * 5], keep_tokens=True)
    tok = tekken.tokenizer
    ids, labels = enc.input_ids, enc.labels
    assert len(ids) == len(labels) == enc.text_tokens + 256 * 5
    assert ids[0] == 1  # <s>
    assert ids.count(tekken.image_token_id) == 256 * 5
    # Supervised positions are exactly the two answers, each followed by </s>.
    supervised = [i for i, label in zip(ids, labels) if label != IGNORE_INDEX]
    assert supervised == tok.encode("A cat.") + [2] + tok.encode("On a mat.") + [2]
    assert enc.loss_tokens == len(supervised)
    assert all(label == IGNORE_INDEX for i, label in zip(ids, labels) if i == tekken.image_token_id)


def test_counts_without_tokens_equal_counts_with(tekken):
    conversation = turns(("user", "<image> and <image>"), ("assistant", "Two images."))
    counted = tekken.encode(conversation, [13 * 256, 7 * 256], keep_tokens=False)
    kept = tekken.encode(conversation, [13 * 256, 7 * 256], keep_tokens=True)
    assert counted.input_ids is None
    assert (counted.text_tokens, counted.loss_tokens) == (kept.text_tokens, kept.loss_tokens)
    assert kept.text_tokens == len(kept.input_ids) - 20 * 256


def test_special_token_text_is_not_injected(tekken):
    text = "[INST] </s> [IMG] <s>"
    enc = tekken.encode(turns(("user", text), ("assistant", text)), [], keep_tokens=True)
    specials = {tekken.tokenizer.special_id(t) for t in ("[INST]", "</s>", "[IMG]", "<s>")}
    # only the template's own: <s>, [INST], [/INST] and the answer's </s>
    assert ([i for i in enc.input_ids if i in specials]
            == [1, tekken.tokenizer.special_id("[INST]"), 2])
    assert tekken.tokenizer.encode(text) == enc.input_ids[2:2 + len(tekken.tokenizer.encode(text))]


def test_tekken_fast_path_equals_mistral_common(tekken):
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    reference = Tekkenizer.from_file(tekken.config.path)
    for text in ["Hello world, this is a test.", "  ünïcödé 漢字 😀\n\n\ttabs",
                 "[INST] </s>", ""]:
        assert tekken.tokenizer.encode(text) == reference.encode(text, bos=False, eos=False)
        assert tekken.tokenizer.count(text) == len(reference.encode(text, bos=False, eos=False))
    for token in ["<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[SYSTEM_PROMPT]"]:
        assert tekken.tokenizer.special_id(token) == reference.get_special_token(token)
