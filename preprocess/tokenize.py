"""The offline demo's tokenizer: a conversation becomes ``input_ids`` and ``labels`` with Tekken
(the file inside the ``mistral-common`` wheel) and the mistral template.

A template names the special tokens around each turn; each image item expands to the image's
token count of ``[IMG]``. Only assistant turns (and their end marker) are supervised. Data
text is encoded without special-token parsing, so a literal ``[INST]`` in a turn stays text.
A model folder's tokenizer and chat template are in ``vlmshard.preprocess.chat``.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from functools import cached_property

from vlmshard.families import DEMO_FAMILY, family
from vlmshard.io import sha256_file
from vlmshard.rejects import Reject

from .conversation import Turn, VideoItem

IGNORE_INDEX = -100


class TekkenTokenizer:
    """Mistral's Tekken (tiktoken BPE) from a ``tekken.json`` file.

    Builds the tiktoken ``Encoding`` straight from the file, as ``mistral-common`` does, but
    without ``Tekkenizer``'s decode tables (1.2 s per worker) and without the Python loop that
    ``Tekkenizer.encode`` runs to shift ids past the special tokens (it costs as much as the BPE;
    counting needs no shift at all). ``tests/test_tokenize.py`` checks ids and special tokens
    against ``Tekkenizer`` itself.
    """

    def __init__(self, path: str) -> None:
        import base64
        import json

        import tiktoken
        from mistral_common.tokens.tokenizers.tekken import Tekkenizer

        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        config = data["config"]
        specials = data.get("special_tokens") or Tekkenizer.DEPRECATED_SPECIAL_TOKENS
        self._shift = config["default_num_special_tokens"]
        self._special = {str(getattr(t["token_str"], "value", t["token_str"])): t["rank"]
                         for t in specials}
        inner = config["default_vocab_size"] - self._shift
        ranks = {base64.b64decode(t["token_bytes"]): t["rank"] for t in data["vocab"][:inner]}
        self.max_token_bytes = max(map(len, ranks))
        self._bpe = tiktoken.Encoding(name=os.path.basename(path), pat_str=config["pattern"],
                                      mergeable_ranks=ranks, special_tokens={})

    def encode(self, text: str) -> list[int]:
        shift = self._shift
        return [t + shift for t in self._bpe.encode_ordinary(text)]

    def count(self, text: str) -> int:
        return len(self._bpe.encode_ordinary(text))

    def special_id(self, token: str) -> int | None:
        return self._special.get(token)


def default_tekken_path() -> str:
    import mistral_common

    return os.path.join(os.path.dirname(mistral_common.__file__), "data", "tekken_240911.json")


@dataclass(frozen=True)
class ChatTemplate:
    """Pieces around each turn. A piece that is a special token of the vocabulary becomes its id;
    any other piece is encoded as text. Assistant text and ``assistant_suffix`` are supervised."""

    name: str
    image_token: str
    bos: tuple[str, ...] = ()
    system_prefix: tuple[str, ...] = ()
    system_suffix: tuple[str, ...] = ()
    user_prefix: tuple[str, ...] = ()
    user_suffix: tuple[str, ...] = ()
    assistant_prefix: tuple[str, ...] = ()
    assistant_suffix: tuple[str, ...] = ()


# Mistral's instruct format with Tekken's control tokens: the offline demo's template.
MISTRAL = ChatTemplate(
    name="mistral", image_token="[IMG]", bos=("<s>",),
    system_prefix=("[SYSTEM_PROMPT]",), system_suffix=("[/SYSTEM_PROMPT]",),
    user_prefix=("[INST]",), user_suffix=("[/INST]",), assistant_suffix=("</s>",))

@dataclass(frozen=True)
class TokenizerConfig:
    """What later stages need to re-tokenize identically (recorded in ``preprocess.json``):
    ``tekken`` (the demo's Tekken file and mistral template), or ``model`` (a model folder's
    tokenizer and chat template; ``path`` is the folder)."""

    kind: str  # "tekken" | "model"
    path: str
    sha256: str = field(default="", compare=False)  # of the tokenizer file (tekken)

    def to_dict(self) -> dict:
        return asdict(self)


def tekken_tokenizer() -> TokenizerConfig:
    path = default_tekken_path()
    return TokenizerConfig(kind="tekken", path=path, sha256=sha256_file(path))


@dataclass
class EncodedSample:
    text_tokens: int
    loss_tokens: int
    input_ids: list[int] | None = None
    labels: list[int] | None = None


class TekkenEncoder:
    """The demo's encoder: Tekken with the mistral template, ``[IMG]`` per image token."""

    PAD = "<pad>"
    name = "the demo's Tekken tokenizer"
    takes_videos = True  # as the demo family (InternVL) writes them, its frames [IMG] runs
    video_token_id = None  # video frames fill the image token

    def __init__(self, config: TokenizerConfig) -> None:
        self.config = config
        self.tokenizer = TekkenTokenizer(config.path)
        self.template = MISTRAL
        self.image_token_id = self.tokenizer.special_id(self.template.image_token)
        self._demo_family = family(DEMO_FAMILY)  # whose frame lines a video becomes
        self.pad_token_id = self.tokenizer.special_id(self.PAD) or 0
        self.media_ids = frozenset({self.image_token_id})  # what --cutoff-len never cuts

    @cached_property
    def _pieces(self) -> dict[str, list[int]]:
        t = self.template
        names = ("bos", "system_prefix", "system_suffix", "user_prefix", "user_suffix",
                 "assistant_prefix", "assistant_suffix")
        return {name: self._encode_pieces(getattr(t, name)) for name in names}

    def _encode_pieces(self, pieces: tuple[str, ...]) -> list[int]:
        ids: list[int] = []
        for piece in pieces:
            special = self.tokenizer.special_id(piece)
            ids.extend([special] if special is not None else self.tokenizer.encode(piece))
        return ids

    def min_text_tokens(self, turns: list[Turn]) -> int:
        """A lower bound of ``encode``'s ``text_tokens`` without tokenizing (a 10 MB turn takes
        seconds): data text is encoded without special tokens, so each token is a vocabulary
        entry of at most ``max_token_bytes`` bytes."""
        n_bytes = sum(len(text.encode("utf-8")) for turn in turns for text in turn.texts)
        return -(-n_bytes // self.tokenizer.max_token_bytes)

    def encode(self, turns: list[Turn], image_tokens: list[int], keep_tokens: bool,
               videos: list = (), tools: list[dict] = ()) -> EncodedSample:
        """``image_tokens[k]`` is the token count of the k-th image item in turn order; each of
        ``videos`` becomes the demo family's frame lines (InternVL's ``Frame{i}: `` text and a
        run of ``[IMG]`` per frame). The text is encoded as written (the template puts nothing
        after an image). Returned ``text_tokens`` exclude image and video tokens; ``seq_len`` =
        text_tokens + Σimage_tokens + Σ video tokens. The demo's template takes no ``tools``.
        """
        if tools or any(t.role not in ("system", "user", "assistant") or t.tool_calls
                        for t in turns):
            raise Reject("template_error", "the row has tools, tool calls or tool results, and "
                                           "the demo tokenizer's template takes none; pass "
                                           "--model with a template that does")
        p = self._pieces
        ids: list[int] = [] if keep_tokens else None
        labels: list[int] = [] if keep_tokens else None
        n_text = n_loss = 0
        next_image = 0
        next_video = iter(videos)

        def add(chunk: list[int], supervised: bool) -> None:
            nonlocal n_text, n_loss
            n_text += len(chunk)
            if supervised:
                n_loss += len(chunk)
            if keep_tokens:
                ids.extend(chunk)
                labels.extend(chunk if supervised else [IGNORE_INDEX] * len(chunk))

        add(p["bos"], False)
        for turn in turns:
            supervised = turn.role == "assistant"
            add(p[f"{turn.role}_prefix"], False)
            for part in turn.content:
                if isinstance(part, VideoItem):
                    for piece in self._demo_family.video_pieces(next(next_video), None):
                        if isinstance(piece, str):
                            add(self.tokenizer.encode(piece), False)
                        elif keep_tokens:
                            ids.extend([self.image_token_id] * piece)
                            labels.extend([IGNORE_INDEX] * piece)
                elif not isinstance(part, str):
                    count = image_tokens[next_image]
                    next_image += 1
                    if keep_tokens:
                        ids.extend([self.image_token_id] * count)
                        labels.extend([IGNORE_INDEX] * count)
                elif keep_tokens:
                    add(self.tokenizer.encode(part), supervised)
                else:
                    n = self.tokenizer.count(part)
                    n_text += n
                    n_loss += n if supervised else 0
            add(p[f"{turn.role}_suffix"], supervised)
        return EncodedSample(text_tokens=n_text, loss_tokens=n_loss, input_ids=ids, labels=labels)
