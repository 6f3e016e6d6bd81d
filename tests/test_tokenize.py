"""Chat templates, label masking and image-token expansion, on both tokenizer kinds."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from vlmshard.preprocess.tokenize import IGNORE_INDEX, ConversationEncoder, resolve_tokenizer


@pytest.fixture(scope="module")
def tekken():
    return ConversationEncoder(resolve_tokenizer("tekken"))


@pytest.fixture(scope="module")
def hf_tokenizer_path(tmp_path_factory):
    words = "describe the image a cat on mat hello world system you are helpful user assistant".split()
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}, "\n": len(words) + 1}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit()])
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<IMG_CONTEXT>"])
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def test_tekken_labels_mask_everything_but_assistant(tekken):
    turns = [("system", "Be brief."), ("user", "<image>\nDescribe the image."),
             ("assistant", "A cat."), ("user", "And?"), ("assistant", "On a mat.")]
    enc = tekken.encode(turns, [256 * 5], keep_tokens=True)
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
    turns = [("user", "<image> and <image>"), ("assistant", "Two images.")]
    counted = tekken.encode(turns, [13 * 256, 7 * 256], keep_tokens=False)
    kept = tekken.encode(turns, [13 * 256, 7 * 256], keep_tokens=True)
    assert counted.input_ids is None
    assert (counted.text_tokens, counted.loss_tokens) == (kept.text_tokens, kept.loss_tokens)
    assert kept.text_tokens == len(kept.input_ids) - 20 * 256


def test_special_token_text_is_not_injected(tekken):
    enc = tekken.encode([("user", "[INST] </s>"), ("assistant", "ok")], [], keep_tokens=True)
    inst = tekken.tokenizer.special_id("[INST]")
    assert enc.input_ids.count(inst) == 1  # only the template's own [INST]


def test_hf_tokenizer_json_with_chatml(hf_tokenizer_path):
    cfg = resolve_tokenizer(hf_tokenizer_path)
    assert (cfg.kind, cfg.template) == ("hf", "chatml")
    enc = ConversationEncoder(cfg)
    out = enc.encode([("user", "<image>\ndescribe the image"), ("assistant", "a cat")], [3],
                     keep_tokens=True)
    start, end, img = (enc.tokenizer.special_id(t) for t in ("<|im_start|>", "<|im_end|>",
                                                              "<IMG_CONTEXT>"))
    assert out.input_ids.count(img) == 3
    assert out.input_ids.count(start) == 2 and out.input_ids.count(end) == 2
    supervised = [i for i, label in zip(out.input_ids, out.labels) if label != IGNORE_INDEX]
    assert supervised == enc.tokenizer.encode("a cat") + [end]


def test_tokenizer_errors(tmp_path, hf_tokenizer_path):
    with pytest.raises(ValueError, match="unknown tokenizer 'gpt5'"):
        resolve_tokenizer("gpt5")
    with pytest.raises(ValueError, match="unknown chat template"):
        resolve_tokenizer("tekken", "llama9")
    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    with pytest.raises(ValueError, match="has no token '<IMG_CONTEXT>'"):
        ConversationEncoder(resolve_tokenizer(str(path)))


def test_tekken_fast_path_equals_mistral_common(tekken):
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    reference = Tekkenizer.from_file(tekken.config.path)
    for text in ["Hello world, this is a test.", "  ünïcödé 漢字 😀\n\n\ttabs", "[INST] </s>", ""]:
        assert tekken.tokenizer.encode(text) == reference.encode(text, bos=False, eos=False)
        assert tekken.tokenizer.count(text) == len(reference.encode(text, bos=False, eos=False))
    for token in ["<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[SYSTEM_PROMPT]"]:
        assert tekken.tokenizer.special_id(token) == reference.get_special_token(token)
