"""The pipeline layers every family shares: ``HFLayer`` (submodules of the ``transformers``
model under their checkpoint names), the LLM's layers (token embedding with the image features
scattered in, decoder layers, final norm, LM head with the summed next-token loss) and
``LayerDef``, one entry of a family's layer list.

A layer is built from a ``meta``-device copy of the model, so building one costs no memory; the
caller then loads its tensors (``vlmshard.train.weights``).
"""

from __future__ import annotations

import copy
import functools
import re
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..kernels import Kernels, compile_block, cudnn_first
from ..micro import CARRIED, TOKENS, LayerOutput, Micro, Phase
from . import liger
from .loss import lm_loss


class HFLayer(nn.Module):
    """A pipeline layer made of submodules of the ``transformers`` model: each is kept under an
    attribute of this layer, and ``paths`` maps the attribute to the model's module path, which
    names its tensors in the checkpoint."""

    # the attribute holding the ``transformers`` module a layer of this kind repeats (a ViT
    # block, a decoder layer): what regional ``torch.compile`` compiles
    repeated: str | None = None

    def __init__(self, model: nn.Module, paths: dict[str, str]) -> None:
        super().__init__()
        self.paths: dict[str, str] = {}
        for attr, path in paths.items():
            self.adopt(model, attr, path)

    def adopt(self, model: nn.Module, attr: str, path: str) -> None:
        """Hold a copy of the model's submodule ``path`` as ``attr``."""
        self.paths[attr] = path
        setattr(self, attr, copy.deepcopy(model.get_submodule(path)))

    def use_kernels(self, kernels: Kernels) -> None:
        """Take the optional kernels ``kernels`` switches on (``vlmshard.train.kernels``), once
        loaded: the regional compile of ``repeated``, else Liger's kernels. A compiled block
        gets Inductor's fusion of its norms, activations and rotary embeddings instead of
        Liger's: Liger's autograd functions in a compiled decoder layer stopped Dynamo (torch
        2.11 on an H200, at the layer's first norm)."""
        if kernels.compile_blocks and self.repeated:
            compile_block(getattr(self, self.repeated), kernels)
        elif kernels.liger:
            liger.fuse(self, getattr(self, self.repeated) if self.repeated else None)
        if kernels.sdpa_cudnn:
            cudnn_first(self)

    def hf_name(self, local: str) -> str:
        """The checkpoint name of this layer's tensor ``local``."""
        attr, _, rest = local.partition(".")
        return f"{self.paths[attr]}.{rest}"

    def restored_buffers(self) -> dict[str, Callable[[], torch.Tensor]]:
        """Buffers no checkpoint stores (``persistent=False``), by local name, each with how
        its module computes it at construction: set after loading (the layer is built on the
        meta device, where they hold nothing)."""
        return {}

    def forward(self, micro: Micro) -> torch.Tensor:
        raise NotImplementedError


class TokenEmbedding(HFLayer):
    """The token embedding: the LLM's first layer, given image features, and, when the model ties
    its weights, also its LM head, given the final hidden states (DeepSpeed then keeps the first
    and last stages' copies equal)."""

    def __init__(self, model: nn.Module, path: str, visual_ids: tuple[int, ...]) -> None:
        super().__init__(model, {"embed": path})
        self.visual_ids = visual_ids

    @property
    def weight(self) -> torch.Tensor:
        return self.embed.weight

    def restored_buffers(self) -> dict[str, Callable[[], torch.Tensor]]:
        """A scaled embedding's scale (Gemma's √hidden), kept as a number too."""
        if hasattr(self.embed, "scalar_embed_scale"):
            return {"embed.embed_scale": lambda: torch.tensor(self.embed.scalar_embed_scale)}
        return {}

    def forward(self, micro: Micro) -> torch.Tensor | LayerOutput:
        if micro.phase.name == "features":
            if micro.host.blank:  # its features go nowhere (on the graph, at zero gradient)
                micro = micro.with_x(micro.x[:0])
            if micro.host.shard is not None:
                micro = media_in_share(micro)
                return LayerOutput(embed_tokens(self, micro), micro.carry)
            return embed_tokens(self, micro)
        return lm_loss(self.weight, micro)


def media_in_share(micro: Micro) -> Micro:
    """A sequence-parallel share's micro-batch with the image features (and the carried ones
    per image token: DeepStack's) of its own image tokens, from the group's media
    (``Exchange.media_rows``)."""
    exchange = micro.exchange
    plan = micro.cached("media_plan", exchange.media_plan)
    carry = {name: exchange.media_rows(t, plan, dim=1) if CARRIED[name] else t
             for name, t in micro.carry.items()}
    return micro.with_x(exchange.media_rows(micro.x, plan), carry=carry)


def embed_tokens(module: TokenEmbedding, micro: Micro) -> torch.Tensor:
    """Token embeddings with each image's and video's features written over its tokens, in
    order."""
    hidden = module.embed(micro.input_ids)
    image = visual_mask(micro.input_ids, module.visual_ids)
    features = micro.x.to(hidden.dtype)
    if features.shape[0] != micro.host.image_tokens:
        raise ValueError(f"{micro.num_tiles} tiles give {features.shape[0]} image features for "
                         f"{micro.host.image_tokens} image tokens")
    # by row index, the count known on the host: masked_scatter's backward (masked_select) makes
    # the host wait for the device once per micro-batch; index_put keeps only the index
    # (index_copy would keep the features too)
    rows = torch.nonzero_static(image, size=micro.host.image_tokens).flatten()
    return hidden.index_put((rows,), features)


class DecoderLayer(HFLayer):
    """One decoder layer of the LLM on the packed tokens: rotary tables from the model's own
    rotary embedding at each sample's position ids, attention within each sample."""

    repeated = "layer"

    def __init__(self, model: nn.Module, path: str, rotary: Callable) -> None:
        super().__init__(model, {"layer": path})
        self.rotary = rotary

    def forward(self, micro: Micro) -> torch.Tensor:
        return self.decode(micro)

    def decode(self, micro: Micro) -> torch.Tensor:
        """The ``transformers`` layer on the packed tokens: the new hidden states."""
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
        return lm_loss(self.weight, micro)


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
    # the (t, h, w) patch grid of one tile, for a ViT that takes grids (Qwen's): a micro-batch
    # without media runs the ViT on one blank tile (``micro.HostMeta.of_batch``)
    blank_grid: tuple[int, int, int] | None = None


def visual_mask(input_ids: torch.Tensor, visual_ids: tuple[int, ...]) -> torch.Tensor:
    """Where image and video features go: one comparison per token id, so no id tensor is
    copied to the device each micro-batch."""
    mask = input_ids == visual_ids[0]
    for token in visual_ids[1:]:
        mask |= input_ids == token
    return mask


def visual_token_ids(config) -> tuple[int, ...]:
    """The tokens image and video features fill: the image token, and Qwen's video token."""
    video = getattr(config, "video_token_id", None)
    return (config.image_token_id,) + ((video,) if video is not None else ())


def language_layers(model: nn.Module, lm: str, visual_ids: tuple[int, ...],
                    rotary: Callable,
                    decoder: Callable[[int], tuple[Callable, str]] | None = None
                    ) -> list[LayerDef]:
    """The LLM's layers (token embedding to LM head) of a model whose language model sits at
    ``lm`` (``embed_tokens``, ``layers``, ``norm``) with its head at ``lm_head``. ``decoder(i)``:
    the class building decoder layer i and its ``variant`` (default: ``DecoderLayer``)."""
    decoder = decoder or (lambda index: (DecoderLayer, ""))
    embed_path = f"{lm}.embed_tokens"
    tied = model.lm_head.weight is model.get_submodule(embed_path).weight
    make_embedding = functools.partial(TokenEmbedding, path=embed_path, visual_ids=visual_ids)
    tied_key = "embed" if tied else None
    layers = [LayerDef("embed_tokens", make_embedding, TOKENS, tied_key)]
    for i in range(len(model.get_submodule(f"{lm}.layers"))):
        block, variant = decoder(i)
        layers.append(LayerDef(f"llm_block_{i}",
                               functools.partial(block, path=f"{lm}.layers.{i}", rotary=rotary),
                               TOKENS, variant=variant))
    layers.append(LayerDef("final_norm", functools.partial(FinalNorm, path=f"{lm}.norm"), TOKENS))
    if tied:
        layers.append(LayerDef("head", make_embedding, Phase("loss"), tied_key))
    else:
        layers.append(LayerDef("head", functools.partial(LMHead, path="lm_head"), Phase("loss")))
    return layers


class Detached:
    """Holds a module that must not become a submodule (no parameters, not saved, not moved with
    the stage): the rotary tables, computed on the device of their input (``x``), where the
    module's buffers move at its first call there (an inverse-frequency table copied from the
    host at every call would make the host wait for the device each time)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, x: torch.Tensor, *args):
        if next(self.module.buffers()).device != x.device:
            self.module.to(x.device)
        return self.module(x, *args)
