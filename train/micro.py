"""A packed micro-batch between pipeline stages and within one.

Between stages a micro-batch travels as a tuple of static shapes: the activation padded to the
plan's caps, then input_ids, position_ids, labels, and where a model has them, what some layers
make for later layers (``Micro.carry``, in ``CARRIED`` order: Qwen3-VL's DeepStack features,
made by ViT blocks and added by the first LLM layers; a MoE model's router statistics, summed
over its layers for the auxiliary loss). Its sizes (``HostMeta``) travel beside the wire, on
the host. Inside a stage it is a ``Micro``: every tensor sliced to the real tiles and tokens, so
every layer computes on real data only, with the attention segments and rotary tables computed
once and shared by the stage's layers (``Micro.cache``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, NamedTuple

import torch

from vlmshard.shards.model_inputs import image_runs, next_token_targets, supervised_tokens
from vlmshard.shards.sequence import Shard

from .attention import Spans
from .sequence_parallel import Exchange

if TYPE_CHECKING:
    from .topology import Topology


@dataclass(frozen=True)
class Phase:
    """What a layer's activation rows are: ``per_tile`` rows per tile, or one per token (0)."""

    name: str
    per_tile: int = 0

    def rows(self, tiles: int, tokens: int) -> int:
        return self.per_tile * tiles if self.per_tile else tokens


TOKENS = Phase("tokens")


@dataclass(frozen=True)
class HostMeta:
    """What a stage needs to know on the host about a micro-batch: the sizes that slice the
    wire and shape every kernel launch. The first stage computes it from the loader's CPU-side
    batch (``of_batch``) and the trainer sends it to the pipeline's other stages over a gloo
    group before the step, so no stage reads a device tensor back (each read would stall the
    GPU's queue)."""

    qv: int  # the caps: the wire's static sizes
    qt: int
    tiles: int
    tokens: int
    image_tokens: int
    supervised: int  # tokens with a next-token target
    grids: list[tuple[int, int, int]]  # (t, h, w) patches of each image; none for InternVL
    sample_lengths: list[int]
    image_runs: list[tuple[int, int]]  # [start, end) of each run of image tokens
    # a sequence-parallel share of a micro-batch: how it sits in the whole (its tokens and
    # image runs above are the share's)
    shard: Shard | None = None
    blank: bool = False  # no media: the ViT runs on one blank tile (``of_batch``)

    @classmethod
    def of_batch(cls, batch: dict, geometry) -> "HostMeta":
        """A collated micro-batch's (``vlmshard.shards.loader``, padded to the caps), for a
        model of ``geometry`` (``models.layers.Geometry``).

        A micro-batch (or a sequence-parallel share) without media is given one blank tile
        (zero pixels; ``geometry.blank_grid`` its grid where the ViT takes grids), whose
        features are dropped at the token embedding: so every rank runs every layer, in the
        same order, whatever its data. DeepSpeed's ZeRO-2 fills its gradient buckets in the
        order gradients become ready and reduces them by position, and ZeRO-3 gathers each
        layer's parameters as it runs: ranks whose backward passes differ mix up or wait on
        each other's collectives."""
        samples = batch["num_samples"]
        cu = batch["cu_seqlens"][:samples + 1].tolist()
        grids = [tuple(g) for g in batch.get("image_grid_thw", torch.zeros(0, 3)).tolist()]
        tiles, qv, blank = batch["num_tiles"], batch["tile_cap"], not batch["num_tiles"]
        if blank:
            tiles, qv = 1, max(qv, 1)
            grids = [geometry.blank_grid] if geometry.blank_grid else []
        return cls(
            qv=qv, qt=batch["input_ids"].shape[0], tiles=tiles, tokens=batch["num_tokens"],
            image_tokens=int(batch["image_token_mask"].sum()),
            supervised=supervised_tokens(batch), grids=grids,
            sample_lengths=[b - a for a, b in zip(cu, cu[1:])],
            image_runs=image_runs(batch["image_token_mask"]), shard=batch.get("shard"),
            blank=blank)


@dataclass
class Micro:
    """One packed micro-batch inside a stage: real rows only, plus the stage's shared metadata."""

    x: torch.Tensor  # the activation: pixels, vision hidden states, image features or hidden
    input_ids: torch.Tensor  # [n]
    position_ids: torch.Tensor  # [n], or [3, n] for mRoPE
    labels: torch.Tensor  # [n]
    host: HostMeta
    backend: str  # attention backend, see vlmshard.train.attention
    phase: Phase  # what ``x`` holds
    wire: tuple  # the padded tuple this stage received
    cache: dict = field(default_factory=dict)  # computed once per micro-batch per stage
    # what earlier layers made for later ones, by name (``CARRIED``); absent when none pending
    carry: dict[str, torch.Tensor] = field(default_factory=dict)
    # a sequence-parallel share's: the ranks sharing its micro-batch (``Topology``)
    sequence_group: torch.distributed.ProcessGroup | None = None

    @property
    def num_tiles(self) -> int:
        return self.host.tiles

    @property
    def num_tokens(self) -> int:
        return self.host.tokens

    def with_x(self, x: torch.Tensor, phase: Phase | None = None, **changes) -> "Micro":
        return replace(self, x=x, phase=phase or self.phase, **changes)

    def with_output(self, out: "torch.Tensor | LayerOutput", phase: Phase) -> "Micro":
        """This micro-batch after a layer that returned ``out``."""
        if isinstance(out, LayerOutput):
            return self.with_x(out.x, phase, carry=out.carry)
        return self.with_x(out, phase)

    def cached(self, key: str, compute: Callable[[], object]):
        if key not in self.cache:
            self.cache[key] = compute()
        return self.cache[key]

    def text_spans(self, bidirectional_images: bool = False) -> Spans:
        """The packed samples, each attending within itself; ``bidirectional_images``: each run
        of image tokens also sees itself whole (Gemma 3). A sequence-parallel share's are the
        whole micro-batch's (its padding a segment of its own), attended over by exchange."""
        shard = self.host.shard
        if shard is None:
            lengths, runs, exchange = self.host.sample_lengths, self.host.image_runs, None
        else:
            lengths = list(shard.sample_lengths) + [shard.padding] * (shard.padding > 0)
            runs, exchange = list(shard.image_runs), self.exchange
        return self.cached(f"text_spans_{bidirectional_images}", lambda: Spans.from_lengths(
            lengths, self.backend, self.x.device, runs if bidirectional_images else None,
            exchange))

    @property
    def exchange(self) -> Exchange:
        """A sequence-parallel share's exchanges with its group."""
        if self.sequence_group is None:
            raise RuntimeError("a sequence-parallel share without its group: give from_wire "
                               "the run's Topology")
        return self.cached("exchange", lambda: Exchange(self.host.shard, self.sequence_group))

    def targets(self) -> torch.Tensor:
        """Each token's next-token target, never across a sample (a sequence-parallel share's
        labels already are: the whole's were shifted before it was cut)."""
        if self.host.shard is not None:
            return self.labels
        return next_token_targets(self.labels, self.text_spans().cu_seqlens)


class LayerOutput(NamedTuple):
    """What a layer returns when it also changes ``Micro.carry`` (else it returns ``x``)."""

    x: torch.Tensor
    carry: dict[str, torch.Tensor]


# What may travel after the four fixed tensors, in this order, and whether its dim 1 holds one
# row per image token (padded to the cap on the wire) or is sent whole.
CARRIED = {
    "deepstack": True,  # [levels, image tokens, hidden]: the first pending level is used next
    "router": False,  # [2, experts]: top-k counts and probability sums over the layers so far
}


def from_wire(wire: tuple, host: HostMeta, phase: Phase, backend: str,
              topology: Topology | None = None) -> Micro:
    """The padded tuple a stage receives, sliced to its real rows as ``host`` says (nothing
    is read back from the device); a sequence-parallel share takes its group from
    ``topology``."""
    x, input_ids, position_ids, labels, *extra = wire
    tokens = host.tokens
    if host.blank:  # a share's pixels hold only its own media's rows: none
        x = _padded(x, phase.rows(host.tiles, tokens))
    carry = {name: t[:, :host.image_tokens] if per_image_token else t
             for (name, per_image_token), t in zip(CARRIED.items(), extra)
             if t.is_floating_point()}  # an absent one travels as an empty integer tensor
    group = (topology.sequence_group(host.shard.sp)
             if host.shard is not None and topology is not None else None)
    return Micro(x=x[:phase.rows(host.tiles, tokens)], input_ids=input_ids[:tokens],
                 position_ids=position_ids[..., :tokens], labels=labels[:tokens], host=host,
                 backend=backend, phase=phase, wire=wire, carry=carry, sequence_group=group)


def _padded(x: torch.Tensor, rows: int, dim: int = 0) -> torch.Tensor:
    missing = rows - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def to_wire(micro: Micro, phase: Phase, tokens_per_tile: int = 1) -> tuple:
    """The tuple a stage sends: the activation padded back to the caps, the pending carry
    (image-token rows padded to the cap: ``tokens_per_tile`` × Qv, at most Qt), the rest as
    received."""
    host = micro.host
    wire = (_padded(micro.x, phase.rows(host.qv, host.qt)), *micro.wire[1:4])
    image_token_cap = min(host.qv * tokens_per_tile, host.qt)
    names = list(CARRIED)
    last = max((names.index(name) for name in micro.carry), default=-1)
    for name in names[:last + 1]:  # up to the last one pending
        t = micro.carry.get(name)
        if t is None:
            t = micro.x.new_empty(0, dtype=torch.long)
        elif CARRIED[name]:
            t = _padded(t, image_token_cap, dim=1)
        wire += (t,)
    return wire


def wire_inputs(batch: dict) -> tuple:
    """A collated micro-batch (``vlmshard.shards.loader``, padded to the caps) as the first
    stage's tuple."""
    return batch["pixel_values"], batch["input_ids"], batch["position_ids"], batch["labels"]
