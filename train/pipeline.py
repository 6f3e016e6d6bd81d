"""The model folder's layers as a DeepSpeed ``PipelineModule``: a supplied stage partition,
per-layer recompute, padding-free stages and the Ave-Token loss.

DeepSpeed's own ``partition_method`` offers uniform / parameters / type: only, and its recompute is
one global ``activation_checkpoint_interval``. ``VLMPipeline`` extends ``PipelineModule`` (no
patch) with ``partition_method="bounds"``, taking the stage boundaries from vlmshard's search;
each layer named in ``recompute`` runs under ``torch.utils.checkpoint`` on its own.

Each stage builds and loads only its own layers (``LayerSpec`` builds lazily, per stage). A tied
token embedding / LM head is a ``TiedLayerSpec``: the first and last stages each hold a copy and
DeepSpeed all-reduces their gradients, so they stay one weight.

A stage's ``forward`` slices the padded tuple it receives to the real tiles and tokens once
(``train.models.unpack``), runs its layers on the real rows only, and pads its output back to the
static shapes the next stage expects. The last stage returns the micro-batch's summed loss.
"""

from __future__ import annotations

import time

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn
from torch.utils.checkpoint import checkpoint

from .hf_model import ModelLayers, model_layers
from .models import LayerDef, Micro, pack, unpack, wire_inputs


class StageClock:
    """This process's forward and backward compute time, summed over its micro-batches.

    DeepSpeed's own timers (``wall_clock_breakdown``) trip an assertion in pipeline mode, so the
    stage times itself: forward around its layers; backward from the moment its output's
    gradient arrives to the moment the last of its parameters has its gradient."""

    def __init__(self) -> None:
        self.forward_s = 0.0
        self.backward_s = 0.0
        self._mark = 0.0

    def take(self) -> tuple[float, float]:
        """(forward, backward) seconds since the last call."""
        out = (self.forward_s, self.backward_s)
        self.forward_s = self.backward_s = 0.0
        return out

    def watch(self, parameters) -> None:
        for p in parameters:
            p.register_post_accumulate_grad_hook(self._on_parameter_grad)

    def output_grad_arrives(self, grad):
        self._mark = time.perf_counter()
        return grad

    def _on_parameter_grad(self, _param) -> None:
        now = time.perf_counter()
        self.backward_s += now - self._mark
        self._mark = now


CLOCK = StageClock()


class PipeLayer(nn.Module):
    """One layer of the model folder, built on meta and loaded with its own tensors only (what a
    DeepSpeed ``LayerSpec`` builds on the stage that holds it)."""

    def __init__(self, path: str, index: int, backend: str) -> None:
        super().__init__()
        self.inner = model_layers(path, backend).build_layer(index)

    @property
    def weight(self) -> torch.Tensor:  # the tied embedding's, for DeepSpeed's tie
        return self.inner.weight

    def forward(self, micro: Micro) -> torch.Tensor:
        return self.inner(micro)


def run_layers(layers: list[nn.Module], defs: list[LayerDef], micro: Micro,
               recompute: list[bool]) -> Micro:
    """The layers in order on one micro-batch, those flagged in ``recompute`` under activation
    checkpointing. Each returns its output rows (the loss, for the head)."""
    for layer, d, again in zip(layers, defs, recompute):
        if again and torch.is_grad_enabled():
            x = checkpoint(layer, micro, use_reentrant=False)
        else:
            x = layer(micro)
        micro = micro.with_x(x, d.output)
    return micro


class VLMPipeline(PipelineModule):
    """``PipelineModule`` over a model folder's layers. ``bounds``: stage s holds layers
    ``bounds[s]:bounds[s + 1]`` (None: DeepSpeed's ``parameters`` method)."""

    def __init__(self, model: ModelLayers, stages: int, loss_fn, *, backend: str,
                 bounds: list[int] | None = None, recompute: set[str] = frozenset(),
                 **kwargs) -> None:
        unknown = set(recompute) - set(model.names)
        if unknown:
            raise ValueError(f"recompute names {sorted(unknown)} are not layers of {model.path} "
                             f"({', '.join(model.names)})")
        self._vlmshard_bounds = bounds
        self.model = model
        self.backend = backend
        specs = []
        for i, d in enumerate(model.defs):
            if d.tied_key:
                specs.append(TiedLayerSpec(d.tied_key, PipeLayer, model.path, i, backend))
            else:
                specs.append(LayerSpec(PipeLayer, model.path, i, backend))
        super().__init__(layers=specs, num_stages=stages, loss_fn=loss_fn,
                         partition_method="bounds" if bounds else "parameters", **kwargs)
        self.layer_indices = range(self._local_start, self._local_stop)
        self.recompute = [model.names[i] in recompute for i in self.layer_indices]
        CLOCK.watch(p for p in self.parameters() if p.requires_grad)

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

    @property
    def stage_layer_names(self) -> list[str]:
        return [self.model.names[i] for i in self.layer_indices]

    def forward(self, wire: tuple):
        start = time.perf_counter()
        first = self.layer_indices[0]
        if first == 0:  # DeepSpeed makes the float inputs require grad; pixels need none
            wire = (wire[0].detach(), *wire[1:])
        micro = unpack(wire, self.model.input_phase(first), self.backend)
        micro = run_layers(self.forward_funcs, [self.model.defs[i] for i in self.layer_indices],
                           micro, self.recompute)
        last = self.layer_indices[-1]
        if last == len(self.model.defs) - 1:
            out = activation = micro.x  # the loss
        else:
            out = pack(micro, self.model.defs[last].output)
            activation = out[0]
        CLOCK.forward_s += time.perf_counter() - start
        if activation.requires_grad:
            activation.register_hook(CLOCK.output_grad_arrives)
        return out


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


def pipeline_inputs(batch: dict, pixel_rows_per_tile: int) -> tuple[tuple, torch.Tensor]:
    """A collated micro-batch (``shards.loader``) as DeepSpeed's (inputs, labels) pair."""
    return wire_inputs(batch, pixel_rows_per_tile), batch["labels"]
