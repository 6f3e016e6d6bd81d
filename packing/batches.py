"""The two value types every packing algorithm shares: its input and its output."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Lengths:
    """What the packer needs of each accepted sample, indexed by ``sample_id`` (0..N-1)."""

    tiles: np.ndarray  # int64: vit_tiles, the ViT batch the sample adds
    tokens: np.ndarray  # int64: seq_len, the LLM sequence the sample adds
    source: np.ndarray  # int32: index into ``sources``
    sources: tuple[str, ...]
    # int64: the tiles of the sample's largest ViT unit (an image, or one temporal step of a
    # video: Qwen's temporal patch, InternVL's frame), which one rank encodes whole under
    # sequence parallelism (``groups.rank_tiles``); None where the input does not say (OmniBal's
    # length files)
    largest: np.ndarray | None = None
    # int64: the sample's supervised tokens (``loss_tokens``), the LM head's rows; None where
    # the input does not say (OmniBal's length files): then ``supervised_or_tokens`` gives its
    # tokens, the most there can be
    supervised: np.ndarray | None = None
    # float64: Σ over the sample's ViT units of their tiles², the work of a ViT that attends
    # across each unit (Qwen's: ``CostModel.a_vs``); None where the input does not say (0 then)
    unit_squares: np.ndarray | None = None

    def __post_init__(self) -> None:
        if not (len(self.tiles) == len(self.tokens) == len(self.source)):
            raise ValueError("tiles, tokens and source must have one entry per sample")
        for name in ("largest", "supervised", "unit_squares"):
            column = getattr(self, name)
            if column is not None and len(column) != len(self.tiles):
                raise ValueError(f"{name} must have one entry per sample")

    def supervised_or_tokens(self) -> np.ndarray:
        """Per sample its supervised tokens, or its tokens (an upper bound) where unknown."""
        return self.tokens if self.supervised is None else self.supervised

    def unit_squares_or_zero(self) -> np.ndarray:
        """Per sample Σ tiles² over its ViT units, 0 where unknown (float64)."""
        return (np.zeros(len(self.tiles)) if self.unit_squares is None
                else self.unit_squares.astype(np.float64))

    def __len__(self) -> int:
        return len(self.tiles)

    def take(self, index: np.ndarray) -> "Lengths":
        return Lengths(self.tiles[index], self.tokens[index], self.source[index], self.sources,
                       None if self.largest is None else self.largest[index],
                       None if self.supervised is None else self.supervised[index],
                       None if self.unit_squares is None else self.unit_squares[index])


def in_token_order(image_tiles: list[int],
                   videos: dict[int, tuple[int, int]]) -> list[tuple[int, int]]:
    """A sample's images and videos as (tiles, ViT units) in token order: each video at its
    item (``videos``: item -> its tiles and temporal steps), the images filling the items the
    videos leave, in order; an image is one unit. Stats and records both place media so."""
    images = iter(image_tiles)
    return [videos[item] if item in videos else (next(images), 1)
            for item in range(len(image_tiles) + len(videos))]


@dataclass(frozen=True)
class MediaUnits:
    """Each sample's images and videos as ViT units, in token order: medium ``j`` of sample
    ``i`` (``offsets[i] <= j < offsets[i + 1]``) is ``tiles[j]`` tiles in ``units[j]`` equal
    units (an image one, a video one per temporal step), what a sequence-parallel group deals
    over its ranks (``groups.deal_units``)."""

    offsets: np.ndarray  # int64 [samples + 1]
    tiles: np.ndarray  # int64 [media]
    units: np.ndarray  # int64 [media]

    def of(self, samples) -> list[tuple[int, int]]:
        """The (tiles, units) of ``samples``' media, in their order."""
        out: list[tuple[int, int]] = []
        for i in samples:
            a, b = self.offsets[i], self.offsets[i + 1]
            out.extend(zip(self.tiles[a:b].tolist(), self.units[a:b].tolist()))
        return out


@dataclass
class Packing:
    """Micro-batches in step-major order, plus the samples left out and why.

    Micro-batch ``b`` holds ``items[offsets[b]:offsets[b + 1]]`` (sample ids, in slot order) and
    sits at step ``b // (ranks·micro_batches)``, rank ``(b // micro_batches) % ranks``, micro
    ``b % micro_batches``, so every step has exactly ``ranks × micro_batches`` micro-batches.
    """

    items: np.ndarray  # int64 sample ids
    offsets: np.ndarray  # int64, len = micro-batches + 1
    ranks: int
    micro_batches: int
    unplaced: np.ndarray  # int64 sample ids
    unplaced_reason: list[str]  # one per unplaced sample

    @property
    def n_micro(self) -> int:
        return len(self.offsets) - 1

    @property
    def steps(self) -> int:
        return self.n_micro // (self.ranks * self.micro_batches)

    def micro_of_item(self) -> np.ndarray:
        """The micro-batch number of each entry of ``items``."""
        return np.repeat(np.arange(self.n_micro, dtype=np.int64), np.diff(self.offsets))

    @classmethod
    def from_bins(cls, items: np.ndarray, bins: np.ndarray, order: np.ndarray, ranks: int,
                  micro_batches: int, unplaced: np.ndarray,
                  unplaced_reason: list[str]) -> "Packing":
        """Build from a bin number per item and the bins' step-major ``order`` (a permutation).

        Items keep their relative order inside a bin: that order becomes the slot order.
        """
        position = np.empty(len(order), np.int64)
        position[order] = np.arange(len(order), dtype=np.int64)
        rank_of_item = position[bins]
        sort = np.argsort(rank_of_item, kind="stable")
        counts = np.bincount(rank_of_item, minlength=len(order))
        offsets = np.zeros(len(order) + 1, np.int64)
        np.cumsum(counts, out=offsets[1:])
        return cls(items[sort].astype(np.int64), offsets, ranks, micro_batches,
                   np.asarray(unplaced, np.int64), list(unplaced_reason))


def concat_steps(packings: list[Packing]) -> Packing:
    """One packing whose steps are those of ``packings`` in turn (the epochs of a plan)."""
    first = packings[0]
    shifts = np.cumsum([0] + [len(p.items) for p in packings[:-1]])
    offsets = np.concatenate([packings[0].offsets[:1]] +
                             [p.offsets[1:] + s for p, s in zip(packings, shifts)])
    return Packing(np.concatenate([p.items for p in packings]), offsets, first.ranks,
                   first.micro_batches, np.concatenate([p.unplaced for p in packings]),
                   [r for p in packings for r in p.unplaced_reason])
