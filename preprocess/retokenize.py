"""What a finished preprocess run recorded, for the stages after it, and re-tokenizing from it.

When the stats table did not keep the token ids (no ``--keep-tokens``), a later stage that needs
them rebuilds them from the sources, exactly as preprocessing did, and checks the result against
the recorded ``seq_len`` and tiles::

    recorded = RecordedPreprocess(read_json("out/preprocess.json"))
    spec = recorded.sample_spec()
    records = SourceRows(spec.sources).records([(row["source"], row["row"]) for row in rows])
    ids, labels = Retokenizer(spec).encode(row, records[(row["source"], row["row"])])

A sample that no longer preprocesses, or no longer to what the stats say, raises
``RetokenizeError`` naming it. ``SourceRows.embedded_media`` gives a record's embedded image
bytes, which the writer copies into the shards.
"""

from __future__ import annotations

import os
from collections import defaultdict

import numpy as np

from vlmshard.errors import InputError, JobError
from vlmshard.families import ModelSpec, policy_from_dict, source_tiling
from vlmshard.io import sha256_file
from vlmshard.rejects import Reject

from .conversation import TEXT_ENCODING, parse_conversation
from .sample import SampleLimits, SampleProcessor, SampleSpec, make_encoder
from .sources import Part, Source, read_part_rows
from .tokenize import TokenizerConfig


class RetokenizeError(JobError):
    """A sample that no longer re-tokenizes to what the stats say; the message names it."""


class RecordedPreprocess:
    """The config a preprocess run recorded in its ``preprocess.json``; a ``ValueError`` names
    one too old to say which model it was made for."""

    def __init__(self, preprocess: dict) -> None:
        self.config = preprocess["config"]
        if "model" not in self.config:
            raise InputError(f"this preprocess output was written by vlmshard "
                             f"{preprocess.get('vlmshard_version', '?')}, before model folders "
                             "were recorded: preprocess it again")
        self.tokenizer = TokenizerConfig(**self.config["tokenizer"])
        self.model = ModelSpec.from_dict(self.config["model"])

    @property
    def keep_tokens(self) -> bool:
        return self.config["keep_tokens"]

    @property
    def retokenizes_alike(self) -> bool:
        """Whether re-tokenizing now gives this run's ids: it used today's text encoding."""
        return self.config.get("text_encoding", 1) == TEXT_ENCODING

    def tokenizer_unchanged(self) -> bool:
        """Whether the recorded tokenizer (the Tekken file, or the model folder's tokenizer and
        config files) is still there, with the same sha256."""
        if self.tokenizer.kind == "model":
            return self.model.unchanged()
        path = self.tokenizer.path
        return os.path.isfile(path) and sha256_file(path) == self.tokenizer.sha256

    def token_ids(self) -> tuple[int, int, int | None]:
        """(image token id, padding id, video token id or None) of the recorded tokenizer and
        template."""
        encoder = make_encoder(self.tokenizer, self.model)
        return encoder.image_token_id, encoder.pad_token_id, encoder.video_token_id

    def source_tilings(self) -> dict[str, dict]:
        """Source name -> the tiling policy (as a dict) its images were counted with."""
        base = policy_from_dict(self.config["tiling"])
        return {s["name"]: source_tiling(base, s["max_num"]).to_dict()
                for s in self.config["sources"]}

    def sample_spec(self) -> SampleSpec:
        """How this run turned source rows into samples (for ``Retokenizer``)."""
        sources = tuple(Source.from_dict({**s, "path": s["file"]["path"]})
                        for s in self.config["sources"])
        return SampleSpec(sources=sources, model=self.model, tokenizer=self.tokenizer,
                          tiling=self.config["tiling"],
                          limits=SampleLimits(**self.config["limits"]))


def sample_where(row: dict) -> str:
    """How messages name a sample of the stats table."""
    return f"sample {row['sample_id']} ({row['source']} row {row['row']})"


class SourceRows:
    """Rows of a run's sources read back by (source name, row number): from their byte spans
    (JSONL, JSON list) or the Parquet row groups holding them, never whole files."""

    def __init__(self, sources: tuple[Source, ...]) -> None:
        self.sources = {s.name: s for s in sources}

    def records(self, keys) -> dict[tuple[str, int], dict | Reject]:
        """The record (or the ``Reject`` of an unreadable row) of each (source, row) in ``keys``."""
        wanted = defaultdict(set)
        for name, number in keys:
            wanted[name].add(number)
        records = {}
        for name, numbers in wanted.items():
            source = self.sources[name]
            # A part without byte spans: read_part_rows finds them in the source's index.
            part = Part(index=-1, source_index=0, rows=np.array(sorted(numbers), np.int64))
            for number, record in read_part_rows(source, part):
                records[(name, number)] = record
        return records

    def embedded_media(self, name: str, number: int, record
                       ) -> tuple[list[bytes | None], list[list[bytes | None]]]:
        """Each image's embedded bytes in a record of source ``name`` (None for a file), and
        each video's, per file it reads (its container, or each frame)."""
        try:
            if isinstance(record, Reject):
                raise record
            found = parse_conversation(record, self.sources[name].format)
        except Reject as r:
            raise RetokenizeError(f"{name} row {number} no longer reads ({r.reason}: "
                                  f"{r.message}); the source changed since packing") from r
        return ([image.data for image in found.images],
                [[ref.data for ref in video.refs] for video in found.videos])


class Retokenizer:
    """Rebuilds ``input_ids``/``labels`` from a source row (as ``SourceRows`` reads it back),
    exactly as preprocessing would, and checks the result against the recorded ``seq_len`` and
    tiles."""

    def __init__(self, spec: SampleSpec) -> None:
        self.samples = SampleProcessor(spec)
        self.index = {s.name: i for i, s in enumerate(spec.sources)}

    def encode(self, row: dict, record) -> tuple[list[int], list[int]]:
        """(input_ids, labels) of a stats row (``sample_id``, ``source``, ``row``, ``seq_len``,
        ``image_tiles``) from its source record; raises ``RetokenizeError``."""
        try:
            new = self.samples.process(self.index[row["source"]], record, keep_tokens=True)
        except Reject as r:
            raise RetokenizeError(f"{sample_where(row)} no longer preprocesses ({r.reason}: "
                                  f"{r.message}); the source changed since packing") from r
        if new["seq_len"] != row["seq_len"] or list(new["image_tiles"]) != row["image_tiles"]:
            raise RetokenizeError(f"{sample_where(row)}: re-tokenized to seq_len "
                                  f"{new['seq_len']} and tiles {new['image_tiles']}, the stats "
                                  f"say {row['seq_len']} and {row['image_tiles']}; the source "
                                  "changed since packing")
        return new["input_ids"], new["labels"]
