"""The streaming loader: each data-parallel rank gets exactly its plan's packed micro-batches.

``ShardDataset(root, rank, world_size, start_step)`` yields one collated micro-batch per record,
in the tensors the model family's ``forward`` takes, packed: ``input_ids``, ``labels``,
``position_ids`` restarting per sample, ``cu_seqlens``, ``image_token_mask``, ``pixel_values``
(images and video frames in token order, each tile count checked against the plan) and the
counts and ids the trainer needs. By default padded to the plan's caps, so every tensor has a
static shape (``pad_to_caps=False``: the real tokens, tiles and patches; ``pad_pixels=False``:
tokens padded, pixels real, for a first stage whose input has no static shape to keep).
``docs/shards.md`` lists every key and its shape.

Shards planned for V virtual ranks serve any world size W dividing V: rank w merges virtual
ranks w·V/W … (w+1)·V/W−1 step by step. Resume is exact: ``start_step`` starts at that step's
first record, a pure function of the step. DataLoader workers take every K-th record (the
DataLoader's round-robin restores the order), each seeking to its own records' byte ranges and
checking their CRC-32s; ``pipe:`` streams and manifests without offsets are read whole by every
worker. With no workers every shard is streamed whole and its sha256 checked too.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from vlmshard.errors import ConfigError, InputError
from vlmshard.families import family
from vlmshard.preprocess.tokenize import IGNORE_INDEX

from .layout import Manifest, ShardEntry, read_manifest
from .reader import SeekingShard, ShardError, iter_shard
from .sequence import media_pieces, share_tokens
from .records import (
    DecodedImage,
    DecodedVideo,
    Record,
    RecordError,
    check_image_tokens,
    decoded_images,
)


class ShardDataset(IterableDataset):
    """Packed micro-batches of one data-parallel rank, streamed from a shard folder or URL."""

    def __init__(self, root: str, rank: int = 0, world_size: int = 1, start_step: int = 0, *,
                 pixel_dtype: torch.dtype | None = None, check_hash: bool = True,
                 pixels: bool = True, pad_to_caps: bool = True,
                 pad_pixels: bool | None = None) -> None:
        self.root = root
        self.manifest: Manifest = read_manifest(root)
        virtual = self.manifest.ranks
        if world_size < 1 or virtual % world_size:
            divisors = [w for w in range(1, virtual + 1) if virtual % w == 0]
            raise ConfigError(f"{root} was planned for {virtual} virtual rank(s); world size "
                              f"{world_size} does not divide it (use one of {divisors}, or pack "
                              "with --virtual-ranks a multiple of your DP size)")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if not 0 <= start_step <= self.manifest.steps:
            raise ValueError(f"start_step {start_step} is outside the {self.manifest.steps} "
                             "steps of these shards")
        for sp in self.manifest.sp_degrees:
            if world_size % sp:
                raise ConfigError(f"{root} has steps of sequence-parallel degree {sp}, which "
                                  f"world size {world_size} does not divide")
        self.rank, self.per_rank = rank, virtual // world_size
        # the folders any of this rank's steps read
        self.folders = sorted({v for sp in self.manifest.sp_degrees
                               for v in self.step_ranks(sp)})
        self.start_step = start_step
        model = self.manifest.model_spec()
        self.family = family(model.family)
        self.pixel_dtype = pixel_dtype or getattr(torch, model.dtype, torch.float32)
        self.check_hash = check_hash
        self.pixels = pixels  # False: pixel_values stay zero (pipeline stages that need no images)
        self.pad_to_caps = pad_to_caps
        self.pad_pixels = pad_to_caps if pad_pixels is None else pad_pixels
        self.policies = self.manifest.policies()
        shapes = {(p.rows_per_tile, p.pixel_shape, p.takes_grid) for p in self.policies.values()}
        if len(shapes) != 1:
            raise InputError(f"{root}: sources make pixel rows of different shapes {shapes}")
        self.rows_per_tile, self.pixel_shape, self.takes_grids = shapes.pop()
        per_tile = {p.tokens_per_tile for p in self.policies.values()}
        self.tokens_per_tile = per_tile.pop() if len(per_tile) == 1 else None

    def step_ranks(self, sp: int) -> list[int]:
        """The virtual ranks whose records this rank takes in a step of sequence-parallel
        degree ``sp``: ranks (w // sp)·sp … (w // sp)·sp + sp − 1 form a group, and rank w
        takes share w mod sp of the micro-batches of the group's virtual data-parallel ranks (k =
        virtual ranks ÷ world size of them, each written to sp virtual ranks:
        ``vlmshard.shards.writer``). At ``sp`` 1 these are virtual ranks w·k … w·k + k − 1."""
        k, w = self.per_rank, self.rank
        return [((w // sp) * k + i) * sp + w % sp for i in range(k)]

    def ranks_at(self, step: int) -> list[int]:
        return self.step_ranks(self.manifest.step_group(step)["sp"])

    @property
    def micro_batches_per_step(self) -> int:
        return self.manifest.micro_batches * self.per_rank

    @property
    def steps(self) -> int:
        return self.manifest.steps

    def __len__(self) -> int:
        return (self.steps - self.start_step) * self.micro_batches_per_step

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for record in self.worker_records(worker, workers):
            yield self.collate(record)

    def records(self) -> Iterator[Record]:
        """This rank's records from ``start_step`` on, merged step by step, checked (not decoded
        into tensors)."""
        streams = {v: self._virtual_rank_records(v) for v in self.folders}
        micro = self.manifest.micro_batches
        for step in range(self.start_step, self.steps):
            # every folder's records of the step are read; the step's ranks' are kept
            records = {v: [next(stream) for _ in range(micro)] for v, stream in streams.items()}
            for v in self.ranks_at(step):
                yield from records[v]
        for v, stream in streams.items():
            extra = next(stream, None)  # also runs the last shard's count and hash checks
            if extra is not None:
                raise ShardError(f"{extra.where}: a record after the last step of rank {v}")

    def record_metas(self) -> Iterator[dict]:
        """What each of ``records()``' records holds (its json member: ``step``, ``samples``...),
        folder by folder: read alone, without its images and tokens, where the shards can be
        sought; else from the whole records (``step`` and ``samples`` only)."""
        if not self.seekable:
            yield from ({"step": r.step, "samples": r.samples} for r in self.records())
            return
        m = self.manifest
        for v in self.folders:
            for entry in m.rank_shards(v):
                shard = SeekingShard(self.root, entry, m)
                try:
                    for index in range(entry.records):
                        step = entry.first_step + index // m.micro_batches
                        if step >= self.start_step and v in self.ranks_at(step):
                            yield shard.meta(index)
                finally:
                    shard.close()

    def _virtual_rank_records(self, rank: int) -> Iterator[Record]:
        problem = self.manifest.coverage_problem(rank)
        if problem:
            raise ShardError(f"{self.root}: manifest: {problem}")
        for entry in self.manifest.rank_shards(rank):
            if entry.end_step <= self.start_step:
                continue
            for record in iter_shard(self.root, entry, self.manifest,
                                     check_hash=self.check_hash):
                if record.step >= self.start_step:
                    yield record

    def worker_records(self, worker: int, workers: int) -> Iterator[Record]:
        """Records ``worker``, ``worker + workers``, ... of ``records()``' order: sought and
        read alone where the shards allow it, else picked from the whole stream."""
        if workers == 1 or not self.seekable:
            return (r for i, r in enumerate(self.records()) if i % workers == worker)
        return self._sought_records(worker, workers)

    @property
    def seekable(self) -> bool:
        """Whether records can be read alone: local or fsspec shards (not a ``pipe:`` stream)
        with per-record offsets."""
        return (not self.root.startswith("pipe:")
                and all(e.seekable for e in self.manifest.shards))

    def _sought_records(self, worker: int, workers: int) -> Iterator[Record]:
        m = self.manifest
        for v in self.folders:
            if problem := m.coverage_problem(v):
                raise ShardError(f"{self.root}: manifest: {problem}")
        shards = {v: iter(m.rank_shards(v)) for v in self.folders}
        current = {v: next(shards[v]) for v in self.folders}
        mine: list[tuple[ShardEntry, int]] = []  # (shard, record index in it), in order
        i = 0
        for step in range(self.start_step, self.steps):
            for v in self.ranks_at(step):
                while step >= current[v].end_step:
                    current[v] = next(shards[v])
                entry = current[v]
                for micro in range(m.micro_batches):
                    if i % workers == worker:
                        mine.append((entry, (step - entry.first_step) * m.micro_batches + micro))
                    i += 1
        last = {entry.path: index for entry, index in mine}
        opened: dict[str, SeekingShard] = {}
        try:
            for entry, index in mine:
                if entry.path not in opened:
                    opened[entry.path] = SeekingShard(self.root, entry, m)
                yield opened[entry.path].read(index)
                if last[entry.path] == index:
                    opened.pop(entry.path).close()
        finally:
            for shard in opened.values():
                shard.close()

    def collate(self, record: Record, share: bool = True) -> dict:
        """One record as tensors (see the module docstring); in a sequence-parallel step, the
        share its virtual rank takes (``vlmshard.shards.sequence``, unpadded), or with
        ``share`` False the whole micro-batch (a reference, a tool)."""
        m = self.manifest
        n = len(record.input_ids)
        group = m.step_group(record.step)
        sp = group["sp"] if share else 1
        qt = group["length"] if self.pad_to_caps and sp == 1 else n
        pad = qt - n
        if pad < 0:
            raise RecordError(f"{record.where}: {n} tokens exceed Qt {group['length']}")
        check_image_tokens(record, m.visual_token_ids, self.policies)
        input_ids = torch.full((qt,), m.pad_token_id, dtype=torch.long)
        input_ids[:n] = torch.from_numpy(record.input_ids.astype(np.int64))
        labels = torch.full((qt,), IGNORE_INDEX, dtype=torch.long)
        labels[:n] = torch.from_numpy(record.labels.astype(np.int64))
        # a share decodes its own pieces only (a video's own steps' frames), the others'
        # headers for their grids
        media = record.media_units()
        pieces = media_pieces(media, sp) if sp > 1 else None
        mine = None if pieces is None else {p.medium: (p.first, p.units) for p in pieces
                                            if p.owner == record.rank % sp}
        images = list(decoded_images(record, self.policies, rgb=self.pixels, own=mine))
        grids = [im.grid for im in images]  # None for InternVL
        steps = [im.video.seconds_per_step if im.is_video else 0.0 for im in images]
        num_tiles = sum(im.tiles for im in images)
        own = images if mine is None else [images[i] for i in sorted(mine)]
        sample_items = [len(s["images"]) + len(s.get("videos", ())) for s in record.samples]
        batch = {
            "input_ids": input_ids, "labels": labels,
            "position_ids": self._position_ids(record, grids, steps, pad),
            "cu_seqlens": torch.tensor(record.cu_seqlens + ([qt] if pad else []),
                                       dtype=torch.int32),
            "image_token_mask": torch.isin(input_ids, torch.tensor(m.visual_token_ids)),
            "pixel_values": self._pixel_values(
                record, own, group["qv"] if sp == 1 else sum(im.own_tiles for im in own)),
            "num_tokens": n, "num_tiles": num_tiles,
            "tile_cap": group["qv"] if self.pad_to_caps else num_tiles,
            "num_pixel_rows": num_tiles * self.rows_per_tile, "num_samples": len(record.samples),
            "sample_images": torch.tensor(sample_items),
            "sample_pixel_rows": torch.tensor(
                [sum(im.tiles for im in items) * self.rows_per_tile
                 for items in _split(images, sample_items)]),
            "media_tiles": torch.tensor([im.tiles for im in images], dtype=torch.long),
            "media_units": torch.tensor([units for _, units in media], dtype=torch.long),
            "media_is_video": torch.tensor([im.is_video for im in images], dtype=torch.bool),
            "media_seconds_per_step": torch.tensor(steps, dtype=torch.float32),
            "sample_ids": torch.tensor([s["sample_id"] for s in record.samples]),
            "pad_token_id": m.pad_token_id,
            "step": record.step, "rank": record.rank, "micro": record.micro,
        }
        if pad:
            batch["image_token_mask"][n:] = False
        if self.takes_grids:
            batch["image_grid_thw"] = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
        if pieces is not None:
            batch = share_tokens(batch, sp, record.rank % sp, self.tokens_per_tile, pieces,
                                 self.rows_per_tile)
        return batch

    def _position_ids(self, record: Record, grids: list, steps: list[float],
                      pad: int) -> torch.Tensor:
        """Each sample's position ids computed for it alone, then the padding's 0..pad-1;
        ``grids`` and ``steps`` are the record's images' and videos' grids and seconds per
        temporal step in token order, sample by sample."""
        parts, start, item = [], 0, 0
        for sample in record.samples:
            ids = record.input_ids[start:start + sample["seq_len"]]
            start += sample["seq_len"]
            n = len(sample["images"]) + len(sample.get("videos", ()))
            parts.append(self.family.position_ids(
                ids, self.manifest.visual_token_ids, grids[item:item + n],
                self.policies[sample["source"]], steps[item:item + n]))
            item += n
        if pad:
            parts.append(np.broadcast_to(np.arange(pad), (*parts[0].shape[:-1], pad)))
        return torch.from_numpy(np.concatenate(parts, axis=-1).astype(np.int64))

    def _pixel_values(self, record: Record, images: list[DecodedImage | DecodedVideo],
                      cap: int) -> torch.Tensor:
        """The rows of ``images`` (a share's: their own steps'), padded to ``cap`` tiles where
        ``pad_pixels`` says."""
        num_tiles = sum(im.own_tiles for im in images)
        tiles = cap if self.pad_pixels else num_tiles
        pixels = torch.zeros((tiles * self.rows_per_tile, *self.pixel_shape),
                             dtype=self.pixel_dtype)
        if not self.pixels:
            return pixels
        row = 0
        for im in images:
            rows = torch.from_numpy(im.pixels())
            if row + len(rows) > len(pixels):
                raise RecordError(f"{record.where}: more than Qv {cap} tiles")
            pixels[row:row + len(rows)] = rows
            row += len(rows)
        return pixels


def _split(items: list, counts: list[int]) -> list[list]:
    """``items`` cut into consecutive runs of ``counts``."""
    bounds = np.cumsum([0, *counts])
    return [items[a:b] for a, b in zip(bounds, bounds[1:])]


def make_loader(root: str, rank: int = 0, world_size: int = 1, start_step: int = 0, *,
                num_workers: int = 0, pin_memory: bool = False, **dataset_kwargs) -> DataLoader:
    """A DataLoader over ``ShardDataset`` yielding one collated micro-batch at a time, in order:
    ``num_workers`` processes decode ahead (4 micro-batches each); ``pin_memory`` for
    asynchronous copies to a GPU."""
    dataset = ShardDataset(root, rank, world_size, start_step, **dataset_kwargs)
    return DataLoader(dataset, batch_size=None, num_workers=num_workers, pin_memory=pin_memory,
                      prefetch_factor=4 if num_workers else None)
