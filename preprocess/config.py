"""Options of ``vlmshard preprocess``: one definition each (flag, YAML key, type, help)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vlmshard.config import ConfigError, option
from vlmshard.fleet import EngineOptions
from vlmshard.families import DEMO_FAMILY, TileBudget, families, model_types

from .conversation import COLUMN_KEYS, RowFormat

DEFAULT_MAX_IMAGE_PIXELS = 89_478_485  # Pillow's decompression-bomb limit


@dataclass(kw_only=True)
class PreprocessConfig(EngineOptions):
    """Options of ``vlmshard preprocess``."""

    inputs: list[str] = option(
        factory=list, positional=True, metavar="INPUT",
        help="conversation files (.json/.jsonl), InternVL meta files, LLaMA-Factory "
             "dataset_info.json files, .parquet or .arrow files, or datasets.save_to_disk "
             "folders (a DatasetDict with --split); more kinds from the modules named in "
             "VLMSHARD_READERS")
    out: str = option(help="output folder")
    format: Literal["auto", "llava", "messages", "texts", "alpaca"] = option(
        "auto", help="how rows hold conversations: llava ('conversations' of from/value), "
                     "messages ('messages' of role/content, content a string with <image> "
                     "placeholders or a list of typed items), texts ('texts' of user/assistant "
                     "pairs, as the_cauldron and FineVision), alpaca (LLaMA-Factory's "
                     "instruction/input/output), or auto (each row by the fields it has; "
                     "not alpaca); a row's 'system' string is its system prompt; a meta file's "
                     "entries may give their own 'format'")
    columns: list[str] = option(
        factory=list, metavar="KEY=NAME",
        help="the source's own names for the fields vlmshard reads, as LLaMA-Factory's "
             f"dataset_info.json maps them; keys: {', '.join(COLUMN_KEYS)} (e.g. "
             "messages=dialog images=pictures role=speaker content=text system=sys)")
    roles: list[str] = option(
        factory=list, metavar="NAME=ROLE",
        help="extra role names and what they are (user, assistant or system), e.g. bot=assistant",
        default_text="human/user, gpt/assistant, system")
    datasets: list[str] = option(
        factory=list, metavar="NAME",
        help="the entries of the meta files (LLaMA-Factory's dataset_info.json, InternVL's meta "
             "file) to read, in this order, comma-separated, as LLaMA-Factory's dataset: names "
             "them; only these are read and judged",
        default_text="every entry; a dataset_info.json with entries that cannot be read (hub, "
                     "ranking, KTO) is refused, listing them")
    split: str | None = option(
        None, help="the split to read from a DatasetDict folder (datasets.save_to_disk)",
        default_text="its only split")
    image_root: str | None = option(
        None, help="folder or URL that relative image paths start from",
        default_text="the annotation file's folder; meta files give 'root'")
    model: str | None = option(
        None, metavar="PATH",
        help="a local Hugging Face model folder (its config.json's model_type picks the family: "
             f"{', '.join(model_types())}): its tokenizer, chat template, image tokens and "
             "image processor limits define the samples",
        default_text="the offline demo: Tekken with the mistral template")
    tiling: str | None = option(
        None, metavar="FAMILY",
        help="demo only (a --model sets its own): the model family whose image processing to "
             f"count with, at transformers' defaults ({', '.join(families())})",
        default_text=DEMO_FAMILY)
    max_patches: int | None = option(
        None, help="most tiles per image, in families with such a limit (InternVL; an "
                   "InternVL meta file's max_dynamic_patch sets it per source)",
        default_text="the model's preprocessor_config.json")
    tile_budget: TileBudget = option(
        "per-image", help="multi-image rows, in families with a tile limit: per-image (each "
                          "image may use max_patches, as transformers does) or per-sample (the "
                          "images share it, as InternVL's training code divides it)")
    keep_tokens: bool = option(False, help="store input_ids and labels in the stats table, so "
                                           "writing shards needs no re-tokenizing")
    max_seq_len: int | None = option(None, help="reject samples longer than this",
                                     default_text="no limit")
    cutoff_len: int | None = option(
        None, metavar="N",
        help="cut samples longer than N tokens as LLaMA-Factory's cutoff_len does (each prompt "
             "and answer in turn, infer_seqlen's split between them), never inside an image's "
             "or video's tokens: a sample whose media do not fit is a 'too_long' reject",
        default_text="no cut: over-long samples are --max-seq-len rejects")
    max_image_pixels: int = option(DEFAULT_MAX_IMAGE_PIXELS,
                                   help="reject images with more pixels, as decompression bombs "
                                        "(Pillow's limit)")
    max_video_seconds: float | None = option(
        None, help="reject videos that run longer than this many seconds (a 'video_too_long' "
                   "reject; read from the container, before any frame is decoded)",
        default_text="no limit")
    decode_videos: bool = option(
        False, help="decode each video's sampled frames too, so a stream corrupt past its first "
                    "frame is a reject here rather than an error when writing shards (the probe "
                    "alone reads the container and decodes one frame: much cheaper)")
    allow_outside_image_root: bool = option(
        False, help="read relative image paths whose '..' leads out of their image root "
                    "(otherwise such a row is a 'path_outside_root' reject)")
    max_reject_ratio: float | None = option(
        None, help="fail (exit 3) if more than this fraction of rows is rejected",
        default_text="no limit")
    part_size: int = option(2048, help="rows per committed part, the unit of resume")
    seed: int = option(0, help="seed for repeat_time < 1 subsampling")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.inputs:
            raise ConfigError("no input given: pass conversation files, meta files, Parquet files "
                              "or saved dataset folders")
        if self.max_patches is not None and self.max_patches < 1:
            raise ConfigError(f"--max-patches must be >= 1, got {self.max_patches}")
        if self.model is not None and self.tiling is not None:
            raise ConfigError("--tiling is for the demo tokenizer; with --model the model "
                              "folder's preprocessor config sets the tiling")
        self.row_format()  # checks --columns and --roles
        self.datasets = list(dict.fromkeys(d for item in self.datasets
                                           for d in str(item).split(",") if d))
        if self.part_size < 1:
            raise ConfigError(f"--part-size must be >= 1, got {self.part_size}")
        if self.max_seq_len is not None and self.max_seq_len < 1:
            raise ConfigError(f"--max-seq-len must be >= 1, got {self.max_seq_len}")
        if self.cutoff_len is not None and self.cutoff_len < 1:
            raise ConfigError(f"--cutoff-len must be >= 1, got {self.cutoff_len}")
        if self.max_reject_ratio is not None and not 0 <= self.max_reject_ratio <= 1:
            raise ConfigError(f"--max-reject-ratio must be in [0, 1], got {self.max_reject_ratio}")


    def row_format(self) -> RowFormat:
        """How the inputs' rows hold conversations (a meta file's entries may say otherwise)."""
        return RowFormat.from_options(self.format, _pairs(self.columns, "--columns"),
                                      _pairs(self.roles, "--roles"))


def _pairs(words: list[str], flag: str) -> dict[str, str]:
    pairs = {}
    for word in words:
        key, sep, value = word.partition("=")
        if not sep or not key or not value:
            raise ConfigError(f"{flag} {word!r}: write KEY=NAME")
        pairs[key] = value
    return pairs
