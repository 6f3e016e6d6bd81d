"""An InternVL-style VLM from plain torch modules, as a flat sequence of pipeline layers.

ViT (patch embedding, pre-norm blocks) → pixel shuffle + MLP projector, whose outputs replace the
image-token embeddings → decoder LLM (RMSNorm, RoPE, SwiGLU, grouped-query attention) → final
norm. The LM head and loss live in ``PackedLMLoss`` so that logits are only ever computed for
supervised tokens, in chunks (a [Qt, vocab] logit tensor would not fit).

Layers pass tuples of tensors with static shapes, as pipeline stages must:

- vision layers: ``(vit_hidden [Qv, patches, Hv], input_ids [Qt], position_ids [Qt],
  image_token_mask [Qt], num_tiles [], num_tokens [])``
- decoder layers: ``(hidden [Qt, H], position_ids [Qt], num_tokens [])``

Packed samples never attend to each other: a new sample starts where ``position_ids`` is 0, and
attention runs causally within each sample (flash-attn's varlen kernel when installed, else
PyTorch SDPA per sample). The padding after ``num_tokens`` takes no part in attention, so its
cost is only the linear layers' (static shapes are the price of pipelining).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from vlmshard.model_sizes import ModelConfig
from vlmshard.preprocess.tokenize import IGNORE_INDEX


# ---------------------------------------------------------------------------------------------
# Vision


class VisionEmbed(nn.Module):
    """Patch embedding of the real tiles (padding tiles stay zero) plus learned positions."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        v = config.vision
        self.patch = nn.Conv2d(3, v.hidden, kernel_size=v.patch_size, stride=v.patch_size)
        self.position = nn.Parameter(torch.zeros(1, (v.image_size // v.patch_size) ** 2,
                                                 v.hidden))
        nn.init.trunc_normal_(self.position, std=0.02)

    def forward(self, inputs: tuple) -> tuple:
        pixel_values, *rest = inputs
        n = int(rest[3])  # num_tiles
        patches = self.patch(pixel_values[:n]).flatten(2).transpose(1, 2) + self.position
        hidden = patches.new_zeros((pixel_values.shape[0],) + patches.shape[1:])
        hidden[:n] = patches
        return (hidden, *rest)


class VisionBlock(nn.Module):
    """Pre-norm transformer block; attention is full within each tile."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        v = config.vision
        self.heads = v.heads
        self.norm1 = nn.LayerNorm(v.hidden)
        self.qkv = nn.Linear(v.hidden, 3 * v.hidden)
        self.proj = nn.Linear(v.hidden, v.hidden)
        self.norm2 = nn.LayerNorm(v.hidden)
        self.mlp = nn.Sequential(nn.Linear(v.hidden, int(v.hidden * v.mlp_ratio)), nn.GELU(),
                                 nn.Linear(int(v.hidden * v.mlp_ratio), v.hidden))

    def forward(self, inputs: tuple) -> tuple:
        hidden, *rest = inputs
        n = int(rest[3])  # num_tiles
        x = hidden[:n]
        t, p, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(t, p, 3, self.heads, h // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2))
        x = x + self.proj(attn.transpose(1, 2).reshape(t, p, h))
        x = x + self.mlp(self.norm2(x))
        out = hidden.clone()
        out[:n] = x
        return (out, *rest)


def pixel_shuffle(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """InternVL's pixel shuffle: [tiles, side², C] → [tiles, (side·r)², C / r²]."""
    t, p, c = x.shape
    side = int(p ** 0.5)
    x = x.view(t, side, side, c)
    x = x.view(t, side, int(side * ratio), int(c / ratio)).permute(0, 2, 1, 3)
    x = x.reshape(t, int(side * ratio), int(side * ratio), int(c / ratio / ratio))
    return x.permute(0, 2, 1, 3).reshape(t, -1, int(c / ratio / ratio))


class ProjectorMerge(nn.Module):
    """Pixel shuffle + MLP projector; writes each tile's embeddings into its image tokens, in
    tile order, over the text embeddings."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        v, t = config.vision, config.llm
        self.ratio = config.downsample_ratio
        width = int(v.hidden / self.ratio ** 2)
        self.projector = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, t.hidden),
                                       nn.GELU(), nn.Linear(t.hidden, t.hidden))
        self.embed_tokens = nn.Embedding(t.vocab_size, t.hidden)

    def forward(self, inputs: tuple) -> tuple:
        vit_hidden, input_ids, position_ids, image_token_mask, num_tiles, num_tokens = inputs
        n = int(num_tiles)
        hidden = self.embed_tokens(input_ids)
        if n:
            image = self.projector(pixel_shuffle(vit_hidden[:n], self.ratio))
            image = image.reshape(-1, image.shape[-1])
            if image.shape[0] != int(image_token_mask.sum()):
                raise ValueError(f"{n} tiles give {image.shape[0]} image embeddings for "
                                 f"{int(image_token_mask.sum())} image tokens")
            hidden = hidden.masked_scatter(image_token_mask[:, None], image.to(hidden.dtype))
        return hidden, position_ids, num_tokens


# ---------------------------------------------------------------------------------------------
# Language model


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) \
            * self.weight


def rotate(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE (rotate-half form) at each token's own position: [tokens, heads, d]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = position_ids.float()[:, None] * inv[None]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None].to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None].to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def segments(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each packed sample: a sample starts where its position is 0."""
    starts = torch.nonzero(position_ids == 0).flatten().tolist()
    return list(zip(starts, starts[1:] + [position_ids.shape[0]]))


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            position_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Causal attention within each packed sample of the first ``num_tokens``; q [tokens, heads,
    d], k/v [tokens, kv, d]. The padding after them attends to nothing (its output is 0)."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        flash_attn_varlen_func = None
    spans = segments(position_ids[:num_tokens])
    out = torch.zeros_like(q)
    if flash_attn_varlen_func is not None and q.is_cuda and spans:
        cu = torch.tensor([0] + [e for _, e in spans], dtype=torch.int32, device=q.device)
        longest = max(e - s for s, e in spans)
        # The kernel takes fp16/bf16 only: an fp32 model attends in bf16 and keeps fp32 around.
        kernel_dtype = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
        q_, k_, v_ = (t[:num_tokens].to(kernel_dtype) for t in (q, k, v))
        out[:num_tokens] = flash_attn_varlen_func(q_, k_, v_, cu, cu, longest, longest,
                                                  causal=True).to(q.dtype)
        return out
    for start, end in spans:
        out[start:end] = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), k[start:end].transpose(0, 1),
            v[start:end].transpose(0, 1), is_causal=True, enable_gqa=True).transpose(0, 1)
    return out


class DecoderBlock(nn.Module):
    """RMSNorm → GQA attention with RoPE → RMSNorm → SwiGLU, both residual."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        t = config.llm
        self.heads, self.kv_heads, self.head_dim = t.heads, t.kv_heads, t.hidden // t.heads
        self.theta = t.rope_theta
        self.norm1 = RMSNorm(t.hidden, t.rms_eps)
        self.q = nn.Linear(t.hidden, t.heads * self.head_dim, bias=False)
        self.kv = nn.Linear(t.hidden, 2 * t.kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(t.heads * self.head_dim, t.hidden, bias=False)
        self.norm2 = RMSNorm(t.hidden, t.rms_eps)
        self.gate_up = nn.Linear(t.hidden, 2 * t.intermediate, bias=False)
        self.down = nn.Linear(t.intermediate, t.hidden, bias=False)

    def forward(self, inputs: tuple) -> tuple:
        hidden, position_ids, num_tokens = inputs
        n = hidden.shape[0]
        x = self.norm1(hidden)
        q = rotate(self.q(x).view(n, self.heads, self.head_dim), position_ids, self.theta)
        k, v = self.kv(x).view(n, 2, self.kv_heads, self.head_dim).unbind(1)
        k = rotate(k, position_ids, self.theta)
        attn = packed_causal_attention(q, k, v, position_ids, int(num_tokens))
        hidden = hidden + self.o(attn.reshape(n, -1))
        gate, up = self.gate_up(self.norm2(hidden)).chunk(2, -1)
        return hidden + self.down(F.silu(gate) * up), position_ids, num_tokens


class FinalNorm(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.llm.hidden, config.llm.rms_eps)

    def forward(self, inputs: tuple) -> tuple:
        hidden, *rest = inputs
        return (self.norm(hidden), *rest)


def layer_specs(config: ModelConfig) -> list[tuple[type[nn.Module], str]]:
    """(layer class, name) of every pipeline layer before the head, in order: the units a stage
    partition cuts between (``config.layer_names()``, whose last is the head)."""
    config.validate()
    classes = ([VisionEmbed] + [VisionBlock] * config.vision.layers + [ProjectorMerge]
               + [DecoderBlock] * config.llm.layers)
    return list(zip(classes, config.layer_names()[:-1]))


# ---------------------------------------------------------------------------------------------
# Head and loss


class PackedLMLoss(nn.Module):
    """LM head + next-token cross entropy summed over supervised tokens.

    The target of token t is label t + 1 within the same packed sample; logits are computed for
    supervised positions only, ``chunk`` rows at a time and recomputed in backward. The sum is
    returned so the trainer can divide by the global batch's supervised-token count (HBP's
    Ave-Token normalization), which makes packing leave the gradient unchanged.
    """

    def __init__(self, config: ModelConfig, chunk: int = 1024) -> None:
        super().__init__()
        self.lm_head = nn.Linear(config.llm.hidden, config.llm.vocab_size, bias=False)
        self.chunk = chunk

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor,
                position_ids: torch.Tensor) -> torch.Tensor:
        targets = next_token_targets(labels, position_ids)
        keep = targets != IGNORE_INDEX
        h, y = hidden[keep], targets[keep]
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, h.shape[0], self.chunk):
            total = total + checkpoint(self._chunk_loss, h[start:start + self.chunk],
                                       y[start:start + self.chunk], use_reentrant=False)
        return total

    def _chunk_loss(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.lm_head(h).float(), y, reduction="sum")


def next_token_targets(labels: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """labels shifted left by one, never across a packed-sample boundary."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    same_sample = position_ids[1:] != 0
    targets[:-1] = torch.where(same_sample, labels[1:], torch.full_like(labels[1:], IGNORE_INDEX))
    return targets


class VLM(nn.Module):
    """The layers run in order on one packed micro-batch: the reference the pipeline must match."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(cls(config) for cls, _ in layer_specs(config))
        self.norm = FinalNorm(config)
        self.loss = PackedLMLoss(config)

    def forward(self, batch: dict) -> torch.Tensor:
        """Summed next-token loss over the batch's supervised tokens."""
        x = (batch["pixel_values"], batch["input_ids"], batch["position_ids"],
             batch["image_token_mask"], torch.tensor(batch["num_tiles"]),
             torch.tensor(batch["num_tokens"]))
        for layer in self.layers:
            x = layer(x)
        hidden, position_ids, _ = self.norm(x)
        return self.loss(hidden, batch["labels"], position_ids)
