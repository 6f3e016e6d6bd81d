"""One rank's share of a packed micro-batch under sequence parallelism (Ulysses).

The ``sp`` ranks of a sequence-parallel group train one micro-batch together. Each holds an equal,
contiguous share of its tokens (the last padded), so every linear layer does 1/sp of the work;
in each attention layer the trainer trades heads for the sequence, so each rank attends over the
whole micro-batch with 1/sp of the heads, and the attention work is even however the samples fall
(``vlmshard.train.sequence_parallel``). Each rank encodes a share of the media, dealt by ViT
units (an image; a video's temporal step, within which the ViT attends), largest first, to the
least loaded rank, so a clip longer than one rank holds spreads over the group; the trainer
gathers their features into token order before the token embedding.

A share is a collated micro-batch (``vlmshard.shards.loader``) of the same keys, cut to the share:
its tokens, position ids and image-token mask; its own pieces' pixel rows, grids and kinds;
``labels`` holding the next-token targets, shifted over the whole micro-batch (the target of a
share's last token is the next share's first label); and ``shard``, a ``Shard`` telling the
trainer how the share sits in the whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlmshard.packing.groups import deal_units
from vlmshard.preprocess.tokenize import IGNORE_INDEX

from .model_inputs import image_runs, next_token_targets


@dataclass(frozen=True)
class Piece:
    """A run of one medium's ViT units that one rank encodes: an image whole, or consecutive
    temporal steps of a video (the ViT attends within a step, so its features are the
    whole's rows)."""

    medium: int  # the image or video, in the micro-batch's token order
    first: int  # its first unit
    units: int
    tiles: int
    owner: int  # the rank that encodes it


@dataclass(frozen=True)
class Shard:
    """Where a share sits in its micro-batch: what a rank knows of the whole, on the host."""

    sp: int  # the ranks sharing the micro-batch
    rank: int  # this share's rank among them
    start: int  # the share's first token in the whole
    length: int  # tokens of every share: the whole is padded to sp × length
    sample_lengths: tuple[int, ...]  # the whole's packed samples
    image_runs: tuple[tuple[int, int], ...]  # the whole's runs of image tokens, [start, end)
    media_tokens: tuple[int, ...]  # per piece of the whole (``media_pieces``): its tokens
    media_owner: tuple[int, ...]  # per piece: the rank that encodes it

    @property
    def padding(self) -> int:
        """Tokens after the whole's last sample: the last share's padding."""
        return self.sp * self.length - sum(self.sample_lengths)


def media_pieces(media: list[tuple[int, int]], sp: int) -> list[Piece]:
    """The pieces ``sp`` ranks encode of media of (tiles, units) each, in token order, as
    ``packing.groups.deal_units`` deals their units: each rank takes its count of a video's
    steps consecutively, in rank order (one segment of frames to decode)."""
    pieces = []
    for i, ((tiles, units), counts) in enumerate(zip(media, deal_units(media, sp))):
        first = 0
        for rank, count in enumerate(counts):
            if count:
                pieces.append(Piece(i, first, count, count * tiles // units, rank))
                first += count
    return pieces


def share(batch: dict, sp: int, rank: int, tokens_per_tile: int) -> dict:
    """Rank ``rank``'s share of a collated micro-batch among ``sp`` ranks (module docstring);
    ``tokens_per_tile``: the image tokens one tile makes (the model's geometry)."""
    tiles, units = batch["media_tiles"].tolist(), batch["media_units"].tolist()
    pieces = media_pieces(list(zip(tiles, units)), sp)
    rows_per_tile = batch["num_pixel_rows"] // max(batch["num_tiles"], 1)
    starts = [0]
    for t in tiles:
        starts.append(starts[-1] + t * rows_per_tile)
    pixels = batch["pixel_values"]
    own = []
    for p in pieces:
        if p.owner == rank:
            first = starts[p.medium] + p.first * tiles[p.medium] // units[p.medium] * rows_per_tile
            own.append(pixels[first:first + p.tiles * rows_per_tile])
    own_pixels = {**batch, "pixel_values": torch.cat(own) if own
                  else pixels.new_zeros((0, *pixels.shape[1:]))}
    return share_tokens(own_pixels, sp, rank, tokens_per_tile, pieces, rows_per_tile)


def share_tokens(batch: dict, sp: int, rank: int, tokens_per_tile: int, pieces: list[Piece],
                 rows_per_tile: int) -> dict:
    """``share`` of a collated micro-batch whose ``pixel_values`` already are this rank's
    pieces' (``media_pieces``; the loader decodes no other's); everything else is the whole
    micro-batch's, real tokens and padding alike."""
    if not 0 <= rank < sp:
        raise ValueError(f"rank {rank} is outside a sequence-parallel group of {sp}")
    n = batch["num_tokens"]
    length = -(-n // sp)
    start, end = min(rank * length, n), min((rank + 1) * length, n)
    pad = length - (end - start)
    samples = batch["num_samples"]
    cu = batch["cu_seqlens"][:samples + 1].tolist()
    mask = batch["image_token_mask"][:n]
    mine = [p for p in pieces if p.owner == rank]
    media = [p.medium for p in mine]
    own_tiles = sum(p.tiles for p in mine)

    def cut(t: torch.Tensor, fill) -> torch.Tensor:  # the share's tokens on the last dim, padded
        part = t[..., start:end]
        return torch.cat([part, part.new_full((*part.shape[:-1], pad), fill)], dim=-1)

    targets = next_token_targets(batch["labels"], batch["cu_seqlens"])
    out = {
        **batch,
        "input_ids": cut(batch["input_ids"], batch["pad_token_id"]),
        "labels": cut(targets[:n], IGNORE_INDEX),
        "position_ids": cut(batch["position_ids"][..., :n], 0),
        "cu_seqlens": torch.tensor([0, length], dtype=torch.int32),
        "image_token_mask": cut(mask, False),
        "num_tokens": length, "num_samples": 1, "num_tiles": own_tiles,
        "tile_cap": own_tiles, "num_pixel_rows": own_tiles * rows_per_tile,
        "media_tiles": torch.tensor([p.tiles for p in mine], dtype=torch.long),
        "media_units": torch.tensor([p.units for p in mine], dtype=torch.long),
        "media_is_video": batch["media_is_video"][media],
        "media_seconds_per_step": batch["media_seconds_per_step"][media],
        "shard": Shard(sp=sp, rank=rank, start=start, length=length,
                       sample_lengths=tuple(b - a for a, b in zip(cu, cu[1:])),
                       image_runs=tuple(image_runs(mask)),
                       media_tokens=tuple(p.tiles * tokens_per_tile for p in pieces),
                       media_owner=tuple(p.owner for p in pieces)),
    }
    if "image_grid_thw" in batch:
        grids = batch["image_grid_thw"][media].clone()
        grids[:, 0] = torch.tensor([p.units for p in mine], dtype=grids.dtype) \
            if mine else grids[:, 0]
        out["image_grid_thw"] = grids
    return out
