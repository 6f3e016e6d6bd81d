"""The VLM as a DeepSpeed ``PipelineModule``: layer specs, a supplied stage partition, per-layer
recompute, and the Ave-Token loss.

DeepSpeed's own ``partition_method`` offers uniform / parameters / type: only, and its recompute is
one global ``activation_checkpoint_interval``. ``VLMPipeline`` extends ``PipelineModule`` (no
patch) with ``partition_method="bounds"``, taking the stage boundaries from vlmshard's search, and
each layer named in ``recompute`` runs under ``torch.utils.checkpoint`` on its own.

Labels travel through the pipeline as the last tuple element, so the last stage's ``Head``
computes the chunked, supervised-only loss without ever building [Qt, vocab] logits.
"""

from __future__ import annotations

import time

import torch
from deepspeed.pipe import LayerSpec, PipelineModule
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import model as M
from vlmshard.model_sizes import ModelConfig


class StageClock:
    """This process's forward and backward compute time, summed over its pipeline layers.

    DeepSpeed's own timers (``wall_clock_breakdown``) trip an assertion in pipeline mode, so each
    layer times itself: forward around its call; backward from the moment its output's gradient
    arrives to the moment each of its parameters has its gradient (recompute included)."""

    def __init__(self) -> None:
        self.forward_s = 0.0
        self.backward_s = 0.0

    def take(self) -> tuple[float, float]:
        """(forward, backward) seconds since the last call."""
        out = (self.forward_s, self.backward_s)
        self.forward_s = self.backward_s = 0.0
        return out


CLOCK = StageClock()


class _Timed(nn.Module):
    """Base of the pipeline layers: ``CLOCK`` accounting around ``compute``."""

    def __init__(self) -> None:
        super().__init__()
        self._mark = 0.0

    def _watch_parameters(self) -> None:
        for p in self.parameters():
            p.register_post_accumulate_grad_hook(self._on_parameter_grad)

    def _on_parameter_grad(self, _param) -> None:
        now = time.perf_counter()
        CLOCK.backward_s += now - self._mark
        self._mark = now

    def _on_output_grad(self, grad):
        self._mark = time.perf_counter()
        return grad

    def forward(self, inputs: tuple):
        start = time.perf_counter()
        out = self.compute(inputs)
        CLOCK.forward_s += time.perf_counter() - start
        first = next((t for t in (out if isinstance(out, tuple) else (out,))
                      if torch.is_tensor(t) and t.requires_grad), None)
        if first is not None:
            first.register_hook(self._on_output_grad)
        return out


class Carry(_Timed):
    """A model layer that passes the labels through, optionally recomputed in backward."""

    def __init__(self, layer_cls: type[nn.Module], config: ModelConfig,
                 recompute: bool = False) -> None:
        super().__init__()
        self.inner = layer_cls(config)
        self.recompute = recompute
        self._watch_parameters()

    def compute(self, inputs: tuple) -> tuple:
        *x, labels = inputs
        if self.recompute and torch.is_grad_enabled():
            out = checkpoint(self.inner, tuple(x), use_reentrant=False)
        else:
            out = self.inner(tuple(x))
        return (*out, labels)


class Head(_Timed):
    """Final norm, LM head and the summed next-token loss of the micro-batch."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = M.FinalNorm(config)
        self.loss = M.PackedLMLoss(config)
        self._watch_parameters()

    def compute(self, inputs: tuple) -> torch.Tensor:
        hidden, position_ids, num_tokens, labels = inputs
        hidden, *_ = self.norm((hidden, position_ids, num_tokens))
        return self.loss(hidden, labels, position_ids)


class AveTokenLoss:
    """DeepSpeed's ``loss_fn``: the micro-batch's summed loss over the step's global count of
    supervised tokens (HBP's Ave-Token), so packing does not change the gradient.

    DeepSpeed divides each micro-batch's loss by the gradient-accumulation steps and averages
    gradients over data-parallel ranks; ``scale`` = GAS × DP undoes both, and the loss DeepSpeed
    reports is then exactly the per-token mean over the global batch.
    """

    def __init__(self) -> None:
        self.scale = 1.0
        self.global_tokens = 1

    def __call__(self, loss_sum: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss_sum * (self.scale / max(1, self.global_tokens))


class VLMPipeline(PipelineModule):
    """``PipelineModule`` with ``partition_method="bounds"``: stage s holds layers
    ``bounds[s]:bounds[s + 1]`` (one more bound than stages)."""

    def __init__(self, *args, bounds: list[int] | None = None, **kwargs) -> None:
        self._vlmshard_bounds = bounds
        super().__init__(*args, **kwargs)

    def _partition_layers(self, method: str = "uniform") -> None:
        if method != "bounds":
            return super()._partition_layers(method)
        bounds = list(self._vlmshard_bounds)
        if len(bounds) != self.num_stages + 1 or bounds[0] != 0 or bounds[-1] != len(
                self._layer_specs) or any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"stage bounds {bounds} do not split {len(self._layer_specs)} "
                             f"layers into {self.num_stages} non-empty stages")
        self.parts = bounds
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=bounds[stage], stop=bounds[stage + 1])


def build_pipeline(config: ModelConfig, stages: int, loss: AveTokenLoss,
                   bounds: list[int] | None = None,
                   recompute: set[str] = frozenset(), **kwargs) -> VLMPipeline:
    """The pipeline module: ``bounds`` from the partition search (None: DeepSpeed's
    ``parameters`` method), ``recompute`` the layer names to recompute in backward."""
    specs = [LayerSpec(Carry, cls, config, name in recompute)
             for cls, name in M.layer_specs(config)]
    specs.append(LayerSpec(Head, config))
    return VLMPipeline(layers=specs, num_stages=stages, loss_fn=loss,
                       partition_method="bounds" if bounds else "parameters", bounds=bounds,
                       **kwargs)


def pipeline_inputs(batch: dict) -> tuple[tuple, torch.Tensor]:
    """A collated micro-batch (``shards.loader``) as DeepSpeed's (inputs, labels) pair."""
    inputs = (batch["pixel_values"], batch["input_ids"], batch["position_ids"],
              batch["image_token_mask"], torch.tensor(batch["num_tiles"]),
              torch.tensor(batch["num_tokens"]), batch["labels"])
    return inputs, batch["labels"]
