"""Ulysses sequence parallelism (Jacobs et al., "DeepSpeed Ulysses", 2023) over packed samples.

The ``sp`` ranks of a group hold contiguous, equal shares of one micro-batch's tokens
(``vlmshard.shards.sequence.share``). Every layer but attention works on its share alone. An
attention layer's q, k and v are exchanged (all-to-all) from "my tokens, all heads" to "all
tokens, my heads", attention runs over the whole micro-batch's samples with the backend the
micro-batch would use anyway, and the output goes back the same way: two all-to-alls each way
per layer, and each rank does 1/sp of the attention however long the samples are. Grouped-query
attention stays grouped: each rank takes its query heads' key/value heads; where the key/value
heads are fewer than ``sp``, each is repeated to ``sp`` first (so ``sp`` must be a multiple of
them), as DeepSpeed-Ulysses does (``model_sizes.sequence_parallel_refusal``).

Before the token embedding each rank sends each other rank the rows of its media features (it
encodes its own images) that fall in that rank's share of the tokens, and puts what it gets
into token order.

All exchanges are torch's functional ``all_to_all_single_autograd`` (gradients flow back
through the reverse exchange; ``torch.distributed.nn.functional``'s, which did the same, is
deprecated from torch 2.13, and the functional one is in every release supported, 2.10 on), on
the group of the share's degree (``vlmshard.train.topology.Topology.sequence_group``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from vlmshard.errors import ConfigError
from vlmshard.model_sizes import sequence_parallel_refusal
from vlmshard.shards.sequence import Shard


@dataclass(frozen=True)
class Exchange:
    """A share's exchanges with the other ranks of its group."""

    shard: Shard
    group: dist.ProcessGroup | None  # the ranks sharing its micro-batch (``Topology``)

    def _swap(self, x: torch.Tensor) -> torch.Tensor:
        """Chunk i of dim 0 to rank i; the result's chunk i is rank i's chunk for this rank."""
        return all_to_all_single_autograd(x.contiguous(), None, None, self.group)

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

    def media_rows(self, own: torch.Tensor, plan: "MediaPlan", dim: int = 0) -> torch.Tensor:
        """This rank's media features (rows in ``dim``, its media in token order) → the rows of
        the share's image tokens, each rank sending each other rank only the rows its share
        takes (``media_plan``)."""
        moved = own.movedim(dim, 0)
        received = all_to_all_single_autograd(
            moved.index_select(0, plan.send_rows.to(own.device)).contiguous(), plan.receive,
            plan.send, self.group)
        return received.index_select(0, plan.order.to(own.device)).movedim(0, dim)

    def media_plan(self) -> "MediaPlan":
        """Which of this rank's media rows go to which rank, and the order of what it gets:
        each share takes the whole's image tokens [a, b) that fall in its tokens; a medium's
        tokens are consecutive in that order (``shards.sequence.Shard``), computed on the
        host."""
        shard = self.shard
        firsts = [0]  # each medium's first image token among the whole's
        for tokens in shard.media_tokens:
            firsts.append(firsts[-1] + tokens)
        ranges = [self.image_tokens_of(rank) for rank in range(shard.sp)]

        # (medium, first, last + 1) of owner's media in [lo, hi)
        def pieces(owner: int, lo: int, hi: int):
            for i, (first, tokens) in enumerate(zip(firsts, shard.media_tokens)):
                if shard.media_owner[i] == owner and min(hi, first + tokens) > max(lo, first):
                    yield i, max(lo, first), min(hi, first + tokens)

        own_first, row = {}, 0  # each own medium's first row among this rank's rows
        for i, owner in enumerate(shard.media_owner):
            if owner == shard.rank:
                own_first[i] = row
                row += shard.media_tokens[i]
        empty = torch.zeros(0, dtype=torch.long)
        sent = [torch.cat([empty] + [torch.arange(a, b) + own_first[i] - firsts[i]
                                     for i, a, b in pieces(shard.rank, lo, hi)])
                for lo, hi in ranges]
        lo, hi = ranges[shard.rank]
        got = [torch.cat([empty] + [torch.arange(a, b) for _, a, b in pieces(owner, lo, hi)])
               for owner in range(shard.sp)]  # the image-token index of each row received
        return MediaPlan(torch.cat(sent), [len(t) for t in sent], [len(t) for t in got],
                         torch.argsort(torch.cat(got), stable=True))

    def image_tokens_of(self, rank: int) -> tuple[int, int]:
        """[a, b): the whole's image tokens (in token order) that share ``rank`` holds."""
        shard = self.shard
        start, end = rank * shard.length, (rank + 1) * shard.length

        def before(position: int) -> int:
            return sum(max(0, min(position, b) - a) for a, b in shard.image_runs)

        return before(start), before(end)


@dataclass(frozen=True)
class MediaPlan:
    """``Exchange.media_plan``: the rows this rank sends (indices into its media features),
    how many to each rank, how many it gets from each, and the order that puts what it gets
    into token order."""

    send_rows: torch.Tensor
    send: list[int]
    receive: list[int]
    order: torch.Tensor


def check_model(model, manifest, *, pp: int, dp: int) -> None:
    """Refuse, in one line each and before any rank starts, shards of packing groups
    (``manifest``: their ``shards.layout.Manifest``) this run cannot train: under pipeline
    parallelism (their steps' shapes differ by group, where stages exchange static ones); with
    sequence-parallel steps, over a ``dp`` their degrees do not divide, or
    for a ``model`` (``hf_model.ModelLayers``) whose heads do not split, whose linear-attention
    layers carry a state along the sequence (Qwen3.5), or whose router statistics a MoE
    auxiliary loss would need summed over the group."""
    if not manifest.step_groups:
        return
    if pp > 1:
        raise ConfigError(f"shards of packing groups (vlmshard pack --groups) run at --pp 1 "
                          f"(their steps' shapes differ by group), not --pp {pp}")
    spread = [sp for sp in manifest.sp_degrees if sp > 1]
    if not spread:
        return
    where = f"the shards' sequence-parallel degrees {spread}"
    for sp in spread:
        if dp % sp:
            raise ConfigError(f"{where}: {sp} does not divide --dp {dp}")
    if getattr(model.config.get_text_config(), "output_router_logits", False):
        raise ConfigError(f"{model.path}: its MoE auxiliary loss needs router statistics over "
                          f"the whole sequence, which {where} split; set output_router_logits "
                          "false or pack without SP groups")
    llm = model.sizes().llm
    for sp in spread:
        if why := sequence_parallel_refusal(llm, sp):
            raise ConfigError(f"{model.path}: {why}, as {where} need; pack for this model "
                              "(vlmshard pack --model) to get groups it can split")
