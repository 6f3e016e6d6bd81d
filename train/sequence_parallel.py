"""Ulysses sequence parallelism (Jacobs et al., "DeepSpeed Ulysses", 2023) over packed samples.

The ``sp`` ranks of a group hold contiguous, equal shares of one micro-batch's tokens
(``vlmshard.shards.sequence.share``). Every layer but attention works on its share alone. An
attention layer's q, k and v are exchanged (all-to-all) from "my tokens, all heads" to "all
tokens, my heads", attention runs over the whole micro-batch's samples with the backend the
micro-batch would use anyway, and the output goes back the same way: two all-to-alls each way
per layer, and each rank does 1/sp of the attention however long the samples are. Grouped-query
attention stays grouped: each rank takes its query heads' key/value heads; where the key/value
heads are fewer than ``sp``, each is repeated to ``sp`` first (so ``sp`` must be a multiple of
them), as DeepSpeed-Ulysses does.

Before the token embedding the ranks' media features (each rank encodes its own images) are
exchanged into token order, and each rank keeps the rows of its share's image tokens.

All exchanges are ``torch.distributed.nn.functional.all_to_all_single`` (gradients flow back
through the reverse exchange), on a group per degree that ``make_groups`` makes once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single

from vlmshard.errors import ConfigError
from vlmshard.shards.sequence import Shard

_GROUPS: dict[int, dist.ProcessGroup] = {}


def make_groups(degrees) -> None:
    """This rank's group for each sequence-parallel degree in ``degrees`` (consecutive ranks
    w·sp … w·sp + sp − 1). Every rank must call it with the same degrees: making a group is
    collective."""
    world, me = dist.get_world_size(), dist.get_rank()
    for sp in sorted(set(degrees)):
        if sp == 1 or sp in _GROUPS:
            continue
        if world % sp:
            raise ConfigError(f"sequence-parallel degree {sp} does not divide the world size "
                              f"{world}")
        for first in range(0, world, sp):
            ranks = list(range(first, first + sp))
            group = dist.new_group(ranks)
            if me in ranks:
                _GROUPS[sp] = group


def check_heads(heads: int, kv_heads: int, sp: int, what: str) -> None:
    """Refuse, in one line, a degree the heads do not allow (module docstring)."""
    if heads % sp or (kv_heads % sp and sp % kv_heads):
        raise ConfigError(f"{what}: {heads} query and {kv_heads} key/value heads do not split "
                          f"over sequence-parallel degree {sp} (it must divide the query heads, "
                          f"and divide the key/value heads or be a multiple of them)")


@dataclass(frozen=True)
class Exchange:
    """A share's exchanges with the other ranks of its group."""

    shard: Shard
    group: dist.ProcessGroup | None

    @classmethod
    def of(cls, shard: Shard) -> "Exchange":
        if shard.sp not in _GROUPS:
            raise RuntimeError(f"no sequence-parallel group of {shard.sp} ranks: make_groups "
                               "first")
        return cls(shard, _GROUPS[shard.sp])

    def _swap(self, x: torch.Tensor) -> torch.Tensor:
        """Chunk i of dim 0 to rank i; the result's chunk i is rank i's chunk for this rank."""
        x = x.contiguous()  # and so the output, which ``empty_like`` lays out as its input
        return all_to_all_single(torch.empty_like(x), x, group=self.group)

    def heads_to_sequence(self, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[1, heads, share, d] each → [1, heads/sp, whole, d]: all tokens, this rank's heads
        (key/value heads first repeated to ``sp`` where fewer)."""
        sp = self.shard.sp
        out = []
        for t in (query, key, value):
            heads, tokens = t.shape[1], t.shape[2]
            if heads < sp:
                t = t.repeat_interleave(sp // heads, dim=1)
                heads = sp
            chunks = self._swap(t[0].reshape(sp, heads // sp, tokens, t.shape[-1]))
            out.append(chunks.transpose(0, 1).reshape(1, heads // sp, sp * tokens, t.shape[-1]))
        return tuple(out)

    def sequence_to_heads(self, out: torch.Tensor) -> torch.Tensor:
        """An attention output [1, whole, heads/sp, d] → [1, share, heads, d]."""
        sp = self.shard.sp
        _, whole, heads, d = out.shape
        chunks = self._swap(out[0].reshape(sp, whole // sp, heads, d))
        return chunks.transpose(0, 1).reshape(1, whole // sp, sp * heads, d)

    def media_rows(self, own: torch.Tensor, order: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's media features (rows in ``dim``, its media in token order) → the rows of
        the share's image tokens (``order``: ``token_order``), from every rank's media."""
        shard = self.shard
        counts = [0] * shard.sp
        for tokens, owner in zip(shard.media_tokens, shard.media_owner):
            counts[owner] += tokens
        moved = own.movedim(dim, 0).contiguous()
        gathered = all_to_all_single(moved.new_empty((sum(counts), *moved.shape[1:])),
                                     torch.cat([moved] * shard.sp), output_split_sizes=counts,
                                     input_split_sizes=[moved.shape[0]] * shard.sp,
                                     group=self.group)
        return gathered[order].movedim(0, dim)

    def token_order(self, device: torch.device) -> torch.Tensor:
        """Rows of the gathered features (rank by rank, each rank's media in token order) that
        the share's image tokens take, in order."""
        shard = self.shard
        first = [0] * shard.sp
        for tokens, owner in zip(shard.media_tokens, shard.media_owner):
            first[owner] += tokens
        first = [sum(first[:r]) for r in range(shard.sp)]
        rows = []
        for tokens, owner in zip(shard.media_tokens, shard.media_owner):
            rows.extend(range(first[owner], first[owner] + tokens))
            first[owner] += tokens
        ends = self.image_tokens_in_share()
        return torch.tensor(rows[ends[0]:ends[1]], dtype=torch.long, device=device)

    def image_tokens_in_share(self) -> tuple[int, int]:
        """[start, end) of the share's image tokens among the whole's."""
        shard = self.shard
        end = shard.start + shard.length
        inside = sum(max(0, min(b, end) - max(a, shard.start)) for a, b in shard.image_runs)
        return shard.image_token_start, shard.image_token_start + inside


def check_model(model, degrees: list[int], *, pp: int, dp: int) -> None:
    """Refuse, in one line each and before any rank starts, shards with sequence-parallel steps
    of ``degrees`` that this run cannot train: under pipeline parallelism, over a ``dp`` they do
    not divide, or for a ``model`` (``hf_model.ModelLayers``) whose heads do not split, whose
    linear-attention layers carry a state along the sequence (Qwen3.5), or whose router
    statistics a MoE auxiliary loss would need summed over the group."""
    spread = [sp for sp in degrees if sp > 1]
    if not spread:
        return
    where = f"the shards' sequence-parallel degrees {spread}"
    if pp > 1:
        raise ConfigError(f"{where} run at --pp 1 (data parallelism over the group's ranks, "
                          f"ZeRO 1-3), not --pp {pp}")
    for sp in spread:
        if dp % sp:
            raise ConfigError(f"{where}: {sp} does not divide --dp {dp}")
    text = model.config.get_text_config()
    if "linear_attention" in (getattr(text, "layer_types", None) or ()):
        raise ConfigError(f"{model.path}: its linear-attention layers carry a state along the "
                          f"sequence, which {where} would cut; pack without SP groups")
    if getattr(text, "output_router_logits", False):
        raise ConfigError(f"{model.path}: its MoE auxiliary loss needs router statistics over "
                          f"the whole sequence, which {where} split; set output_router_logits "
                          "false or pack without SP groups")
    for sp in spread:
        check_heads(text.num_attention_heads, text.num_key_value_heads, sp, model.path)
