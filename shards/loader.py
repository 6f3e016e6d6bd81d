"""The streaming loader: each data-parallel rank gets exactly its plan's packed micro-batches.

``ShardDataset(root, rank, world_size, start_step)`` yields one collated micro-batch per record,
padded to the plan's caps so every tensor has a static shape:

- ``input_ids`` [Qt], ``labels`` [Qt] (-100 on padding and non-assistant tokens);
- ``position_ids`` [Qt], restarting at 0 for each packed sample (and for the padding);
- ``cu_seqlens`` [samples + 1, or + 2 with padding] int32: sample boundaries, ending at Qt (the
  padding is a segment of its own, so varlen attention kernels can take the tensors as they are);
- ``image_token_mask`` [Qt] bool: where the image embeddings go, in tile order;
- ``pixel_values`` [Qv, 3, S, S]: each image decoded and cut by the recorded tiling policy, tile
  counts checked against the plan, normalized for the ViT, zero tiles after ``num_tiles``;
- ``num_tokens``, ``num_tiles``, ``num_samples``, ``sample_ids``, ``step``, ``rank``, ``micro``.

Order and elasticity: shards planned for V virtual ranks serve any world size W dividing V. Rank
w merges virtual ranks w·V/W … (w+1)·V/W−1 step by step, so each step it yields
``micro_batches × V/W`` records (the gradient-accumulation micro-batches of that step). Resume is
exact: ``start_step`` starts at that step's first record, a pure function of the step.

DataLoader workers take every K-th record, which the DataLoader's round-robin turns back into the
exact order; each worker reads every byte (to check the hashes and the sequence) but decodes
images only for its own records.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from vlmshard.preprocess.tokenize import IGNORE_INDEX

from .layout import Manifest, read_manifest
from .reader import ShardError, iter_shard
from .records import Record, RecordError, check_image_tokens, image_tiles


class ShardDataset(IterableDataset):
    """Packed micro-batches of one data-parallel rank, streamed from a shard folder or URL."""

    def __init__(self, root: str, rank: int = 0, world_size: int = 1, start_step: int = 0, *,
                 pixel_dtype: torch.dtype = torch.float32, check_hash: bool = True,
                 pixels: bool = True) -> None:
        self.root = root
        self.manifest: Manifest = read_manifest(root)
        virtual = self.manifest.ranks
        if world_size < 1 or virtual % world_size:
            divisors = [w for w in range(1, virtual + 1) if virtual % w == 0]
            raise ValueError(f"{root} was planned for {virtual} virtual rank(s); world size "
                             f"{world_size} does not divide it (use one of {divisors}, or pack "
                             "with --virtual-ranks a multiple of your DP size)")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if not 0 <= start_step <= self.manifest.steps:
            raise ValueError(f"start_step {start_step} is outside the {self.manifest.steps} "
                             "steps of these shards")
        per_rank = virtual // world_size
        self.virtual_ranks = range(rank * per_rank, (rank + 1) * per_rank)
        self.start_step = start_step
        self.pixel_dtype = pixel_dtype
        self.check_hash = check_hash
        self.pixels = pixels  # False: pixel_values stay zero (pipeline stages that need no images)
        self.policies = self.manifest.policies()
        sizes = {p.tile_size for p in self.policies.values()}
        if len(sizes) != 1:
            raise ValueError(f"{root}: sources tile at different sizes {sorted(sizes)}")
        self.tile_size = sizes.pop()

    @property
    def micro_batches_per_step(self) -> int:
        return self.manifest.micro_batches * len(self.virtual_ranks)

    @property
    def steps(self) -> int:
        return self.manifest.steps

    def __len__(self) -> int:
        return (self.steps - self.start_step) * self.micro_batches_per_step

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for i, record in enumerate(self.records()):
            if i % workers == worker:
                yield self.collate(record)

    def records(self) -> Iterator[Record]:
        """This rank's records from ``start_step`` on, merged step by step, checked (not decoded
        into tensors)."""
        streams = [self._virtual_rank_records(v) for v in self.virtual_ranks]
        micro = self.manifest.micro_batches
        for step in range(self.start_step, self.steps):
            for stream in streams:
                for _ in range(micro):
                    yield next(stream)
        for v, stream in zip(self.virtual_ranks, streams):
            extra = next(stream, None)  # also runs the last shard's count and hash checks
            if extra is not None:
                raise ShardError(f"{extra.where}: a record after the last step of rank {v}")

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

    def collate(self, record: Record) -> dict:
        """One record as static-shape tensors (see the module docstring)."""
        m = self.manifest
        n = len(record.input_ids)
        pad = m.qt - n
        if pad < 0:
            raise RecordError(f"{record.where}: {n} tokens exceed Qt {m.qt}")
        input_ids = torch.full((m.qt,), m.pad_token_id, dtype=torch.long)
        input_ids[:n] = torch.from_numpy(record.input_ids.astype(np.int64))
        labels = torch.full((m.qt,), IGNORE_INDEX, dtype=torch.long)
        labels[:n] = torch.from_numpy(record.labels.astype(np.int64))
        segments = record.seq_lens + ([pad] if pad else [])
        position_ids = torch.from_numpy(np.concatenate([np.arange(s) for s in segments]))
        cu_seqlens = torch.tensor(record.cu_seqlens + ([m.qt] if pad else []), dtype=torch.int32)
        check_image_tokens(record, m.image_token_id, self.policies)
        image_token_mask = torch.zeros(m.qt, dtype=torch.bool)
        image_token_mask[:n] = input_ids[:n] == m.image_token_id
        pixel_values = self._pixel_values(record)
        return {
            "input_ids": input_ids, "labels": labels, "position_ids": position_ids,
            "cu_seqlens": cu_seqlens, "image_token_mask": image_token_mask,
            "pixel_values": pixel_values,
            "num_tokens": n, "num_tiles": sum(t for s in record.samples for t in s["image_tiles"]),
            "num_samples": len(record.samples),
            "sample_ids": torch.tensor([s["sample_id"] for s in record.samples]),
            "step": record.step, "rank": record.rank, "micro": record.micro,
        }

    def _pixel_values(self, record: Record) -> torch.Tensor:
        m, size = self.manifest, self.tile_size
        pixels = torch.zeros((m.qv, 3, size, size), dtype=self.pixel_dtype)
        if not self.pixels:
            return pixels
        tile = 0
        for policy, tiles in image_tiles(record, self.policies):
            if tile + len(tiles) > m.qv:
                raise RecordError(f"{record.where}: more than Qv {m.qv} tiles")
            pixels[tile:tile + len(tiles)] = normalize_tiles(tiles, policy.mean, policy.std)
            tile += len(tiles)
        return pixels


def normalize_tiles(tiles: np.ndarray, mean, std) -> torch.Tensor:
    """uint8 [n, S, S, 3] → float [n, 3, S, S], scaled to [0, 1] and standardized per channel."""
    t = torch.from_numpy(tiles).permute(0, 3, 1, 2).to(torch.float32).div_(255)
    return t.sub_(torch.tensor(mean)[:, None, None]).div_(torch.tensor(std)[:, None, None])


def make_loader(root: str, rank: int = 0, world_size: int = 1, start_step: int = 0, *,
                num_workers: int = 0, **dataset_kwargs) -> DataLoader:
    """A DataLoader over ``ShardDataset`` yielding one collated micro-batch at a time, in order."""
    dataset = ShardDataset(root, rank, world_size, start_step, **dataset_kwargs)
    return DataLoader(dataset, batch_size=None, num_workers=num_workers,
                      prefetch_factor=4 if num_workers else None)
