"""Real Hugging Face VLMs as a flat list of pipeline layers that wrap their ``transformers`` modules.

A layer is built from a ``meta``-device copy of the model, so building one costs no memory; the
caller then loads its tensors (``train.weights``). Each family module (``internvl``, ``qwen2vl``,
keyed like ``vlmshard.preprocess.families``) lists the layers of its model in order:

    vision embedding, each vision block, projector / merger        (``Phase`` per tile)
    token embedding with the image features scattered in,
    each decoder layer, final norm                                  (``Phase`` per token)
    LM head with the summed next-token loss

Between pipeline stages a micro-batch travels as a tuple of static shapes: the activation padded
to the plan's caps, then input_ids, position_ids, ``HostMeta`` as one int64 tensor, and labels.
Inside a stage it is a ``Micro``: the metadata read to the host in one transfer (the stage's only
host synchronisation for that micro-batch), every tensor sliced to the real tiles and tokens, so
every layer computes on real data only, with the attention segments and rotary tables computed
once and shared by the stage's layers (``Micro.cache``).
"""

from __future__ import annotations

import copy
import functools
import re
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from vlmshard.preprocess.tokenize import IGNORE_INDEX

from ..attention import Spans


# ---------------------------------------------------------------------------------------------
# The micro-batch between and within stages


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
    """What a stage needs to know on the host about a micro-batch. It is computed by the first
    stage from the loader's CPU-side batch and travels as one tensor, so a stage's layers never
    read a device tensor back (each read would stall the GPU's queue)."""

    qv: int  # the caps: the wire's static sizes
    qt: int
    tiles: int
    tokens: int
    image_tokens: int
    supervised: int  # tokens with a next-token target
    grids: list[tuple[int, int, int]]  # (t, h, w) patches of each image; none for InternVL
    sample_lengths: list[int]

    _HEADER = 8  # qv, qt, tiles, tokens, image_tokens, supervised, images, samples

    @staticmethod
    def size(qv: int, qt: int) -> int:
        """The tensor's length for these caps: a header, Qv grids, Qt sample lengths."""
        return HostMeta._HEADER + 3 * qv + qt

    def encode(self) -> torch.Tensor:
        values = [self.qv, self.qt, self.tiles, self.tokens, self.image_tokens, self.supervised,
                  len(self.grids), len(self.sample_lengths)]
        values += [v for grid in self.grids for v in grid]
        values += [0] * (HostMeta._HEADER + 3 * self.qv - len(values)) + self.sample_lengths
        values += [0] * (self.size(self.qv, self.qt) - len(values))
        return torch.tensor(values, dtype=torch.long)

    @classmethod
    def decode(cls, values: list[int]) -> "HostMeta":
        qv, qt, tiles, tokens, image_tokens, supervised, images, samples = values[:cls._HEADER]
        grids = values[cls._HEADER:cls._HEADER + 3 * images]
        start = cls._HEADER + 3 * qv
        return cls(qv, qt, tiles, tokens, image_tokens, supervised,
                   [tuple(grids[i:i + 3]) for i in range(0, len(grids), 3)],
                   values[start:start + samples])


@dataclass
class Micro:
    """One packed micro-batch inside a stage: real rows only, plus the stage's shared metadata."""

    x: torch.Tensor  # the activation: pixels, vision hidden states, image features or hidden
    input_ids: torch.Tensor  # [n]
    position_ids: torch.Tensor  # [n], or [3, n] for mRoPE
    labels: torch.Tensor  # [n]
    host: HostMeta
    backend: str  # attention backend, see train.attention
    phase: Phase  # what ``x`` holds
    wire: tuple  # the padded tuple this stage received
    cache: dict = field(default_factory=dict)  # computed once per micro-batch per stage

    @property
    def num_tiles(self) -> int:
        return self.host.tiles

    @property
    def num_tokens(self) -> int:
        return self.host.tokens

    def with_x(self, x: torch.Tensor, phase: Phase | None = None) -> "Micro":
        return replace(self, x=x, phase=phase or self.phase)

    def cached(self, key: str, compute: Callable[[], object]):
        if key not in self.cache:
            self.cache[key] = compute()
        return self.cache[key]

    def text_spans(self) -> Spans:
        """The packed samples, each attending within itself."""
        return self.cached("text_spans", lambda: Spans.from_lengths(
            self.host.sample_lengths, True, self.backend, self.x.device))


def unpack(wire: tuple, phase: Phase, backend: str) -> Micro:
    """The padded tuple a stage receives, sliced to its real rows (one host read)."""
    x, input_ids, position_ids, meta, labels = wire
    host = HostMeta.decode(meta.tolist())
    tokens = host.tokens
    return Micro(x=x[:phase.rows(host.tiles, tokens)], input_ids=input_ids[:tokens],
                 position_ids=position_ids[..., :tokens], labels=labels[:tokens], host=host,
                 backend=backend, phase=phase, wire=wire)


def pack(micro: Micro, phase: Phase) -> tuple:
    """The tuple a stage sends: the activation padded back to the caps, the rest as received."""
    capacity = phase.rows(micro.host.qv, micro.host.qt)
    x = micro.x
    if x.shape[0] < capacity:
        x = torch.cat([x, x.new_zeros((capacity - x.shape[0], *x.shape[1:]))])
    return (x, *micro.wire[1:])


def supervised_tokens(batch: dict) -> int:
    """Tokens of a collated micro-batch with a next-token target (the Ave-Token count)."""
    return int((next_token_targets(batch["labels"], batch["cu_seqlens"]) != IGNORE_INDEX).sum())


def wire_inputs(batch: dict, pixel_rows_per_tile: int) -> tuple:
    """A collated micro-batch (``shards.loader``, padded to the caps) as the first stage's tuple,
    its host metadata computed here from the CPU-side batch."""
    samples = batch["num_samples"]
    cu = batch["cu_seqlens"][:samples + 1].tolist()
    host = HostMeta(
        qv=batch["pixel_values"].shape[0] // pixel_rows_per_tile, qt=batch["input_ids"].shape[0],
        tiles=batch["num_tiles"], tokens=batch["num_tokens"],
        image_tokens=int(batch["image_token_mask"].sum()), supervised=supervised_tokens(batch),
        grids=[tuple(g) for g in batch.get("image_grid_thw", torch.zeros(0, 3)).tolist()],
        sample_lengths=[b - a for a, b in zip(cu, cu[1:])])
    return (batch["pixel_values"], batch["input_ids"], batch["position_ids"], host.encode(),
            batch["labels"])


# ---------------------------------------------------------------------------------------------
# Layers


class HFLayer(nn.Module):
    """A pipeline layer made of submodules of the ``transformers`` model: each is kept under an
    attribute of this layer, and ``paths`` maps the attribute to the model's module path, which
    names its tensors in the checkpoint."""

    def __init__(self, model: nn.Module, paths: dict[str, str]) -> None:
        super().__init__()
        self.paths = dict(paths)
        for attr, path in self.paths.items():
            setattr(self, attr, copy.deepcopy(model.get_submodule(path)))

    def hf_name(self, local: str) -> str:
        """The checkpoint name of this layer's tensor ``local``."""
        attr, _, rest = local.partition(".")
        return f"{self.paths[attr]}.{rest}"

    def forward(self, micro: Micro) -> torch.Tensor:
        raise NotImplementedError


class TokenEmbedding(HFLayer):
    """The token embedding: the LLM's first layer, given image features, and, when the model ties
    its weights, also its LM head, given the final hidden states (DeepSpeed then keeps the first
    and last stages' copies equal)."""

    def __init__(self, model: nn.Module, path: str, image_token_id: int) -> None:
        super().__init__(model, {"embed": path})
        self.image_token_id = image_token_id

    @property
    def weight(self) -> torch.Tensor:
        return self.embed.weight

    def forward(self, micro: Micro) -> torch.Tensor:
        if micro.phase.name == "features":
            return embed_tokens(self, micro)
        return lm_loss(self, micro)


def embed_tokens(module: TokenEmbedding, micro: Micro) -> torch.Tensor:
    """Token embeddings with each image's features written over its image tokens, in order."""
    hidden = module.embed(micro.input_ids)
    image = micro.input_ids == module.image_token_id
    features = micro.x.to(hidden.dtype)
    if features.shape[0] != micro.host.image_tokens:
        raise ValueError(f"{micro.num_tiles} tiles give {features.shape[0]} image features for "
                         f"{micro.host.image_tokens} image tokens")
    return hidden.masked_scatter(image[:, None], features)


class DecoderLayer(HFLayer):
    """One decoder layer of the LLM on the packed tokens: rotary tables from the model's own
    rotary embedding at each sample's position ids, attention within each sample."""

    def __init__(self, model: nn.Module, path: str, rotary: Callable) -> None:
        super().__init__(model, {"layer": path})
        self.rotary = rotary

    def forward(self, micro: Micro) -> torch.Tensor:
        positions = micro.position_ids[..., None, :]  # a batch of one: [1, n] or [3, 1, n]
        rope = micro.cached("text_rope", lambda: self.rotary(micro.x[None], positions))
        out = self.layer(micro.x[None], attention_mask=None, position_embeddings=rope,
                         use_cache=False, **micro.text_spans().kwargs())
        return (out[0] if isinstance(out, tuple) else out)[0]


class FinalNorm(HFLayer):
    def __init__(self, model: nn.Module, path: str) -> None:
        super().__init__(model, {"norm": path})

    def forward(self, micro: Micro) -> torch.Tensor:
        return self.norm(micro.x)


class LMHead(HFLayer):
    """An LM head with weights of its own (a model that does not tie it to the embedding)."""

    def __init__(self, model: nn.Module, path: str) -> None:
        super().__init__(model, {"head": path})

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    def forward(self, micro: Micro) -> torch.Tensor:
        return lm_loss(self, micro)


def lm_loss(module: nn.Module, micro: Micro, chunk: int = 1024) -> torch.Tensor:
    """Next-token cross entropy summed over the supervised tokens (the target of token t is label
    t + 1 of the same sample). Logits exist only for supervised tokens, ``chunk`` rows at a time,
    recomputed in backward: a [tokens, vocab] tensor would not fit."""
    targets = next_token_targets(micro.labels, micro.text_spans().cu_seqlens)
    # the supervised rows, their count known on the host: no read back of the mask
    keep = torch.nonzero_static(targets != IGNORE_INDEX, size=micro.host.supervised).flatten()
    hidden, targets = micro.x.index_select(0, keep), targets.index_select(0, keep)
    total = micro.x.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk):
        total = total + checkpoint(_chunk_loss, hidden[start:start + chunk], module.weight,
                                   targets[start:start + chunk], use_reentrant=False)
    return total


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
    return F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="sum")


def next_token_targets(labels: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``labels`` shifted left by one, never across a sample boundary (``cu_seqlens``)."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:-1] = labels[1:]
    targets[cu_seqlens[1:].long() - 1] = IGNORE_INDEX  # each sample's last token
    return targets


# ---------------------------------------------------------------------------------------------
# A family's layer list


@dataclass(frozen=True)
class LayerDef:
    """One pipeline layer: its name (the unit a partition cuts between and recompute names), how
    to build it from the meta model, the phase of its output, and for a layer whose weights are
    one with another layer's, their common key."""

    name: str
    build: Callable[[nn.Module], nn.Module]
    output: Phase
    tied_key: str | None = None
    variant: str = ""  # layers of one kind that cost differently (Qwen2.5's full-attention blocks)

    @property
    def kind(self) -> str:
        """Layers of one kind have the same shapes and cost: ``llm_block_3`` → ``llm_block``."""
        return re.sub(r"_\d+$", "", self.name) + (f"_{self.variant}" if self.variant else "")


@dataclass(frozen=True)
class Geometry:
    """What the wire's layout depends on: rows per tile of pixels, ViT states and features."""

    pixel_rows_per_tile: int
    tokens_per_tile: int


def language_layers(model: nn.Module, lm: str, image_token_id: int,
                    rotary: Callable) -> list[LayerDef]:
    """The LLM's layers (token embedding to LM head) of a model whose language model sits at
    ``lm`` (``embed_tokens``, ``layers``, ``norm``) with its head at ``lm_head``."""
    embed_path = f"{lm}.embed_tokens"
    tied = model.lm_head.weight is model.get_submodule(embed_path).weight
    make_embedding = functools.partial(TokenEmbedding, path=embed_path,
                                       image_token_id=image_token_id)
    tied_key = "embed" if tied else None
    layers = [LayerDef("embed_tokens", make_embedding, TOKENS, tied_key)]
    layers += [LayerDef(f"llm_block_{i}",
                        functools.partial(DecoderLayer, path=f"{lm}.layers.{i}", rotary=rotary),
                        TOKENS)
               for i in range(len(model.get_submodule(f"{lm}.layers")))]
    layers.append(LayerDef("final_norm", functools.partial(FinalNorm, path=f"{lm}.norm"), TOKENS))
    if tied:
        layers.append(LayerDef("head", make_embedding, Phase("loss"), tied_key))
    else:
        layers.append(LayerDef("head", functools.partial(LMHead, path="lm_head"), Phase("loss")))
    return layers


class Detached:
    """Holds a module that must not become a submodule (no parameters, not saved, not moved):
    the rotary tables, computed on the device of their input."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args):
        return self.module(*args)
