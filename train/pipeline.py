"""The model folder's layers as a DeepSpeed ``PipelineModule``: a supplied stage partition,
per-layer recompute, padding-free stages and the Ave-Token loss.

DeepSpeed's own ``partition_method`` offers uniform / parameters / type: only, and its recompute is
one global ``activation_checkpoint_interval``. ``VLMPipeline`` extends ``PipelineModule`` (no
patch) with ``partition_method="bounds"``, taking the stage boundaries from vlmshard's search;
each layer named in ``recompute`` (or ``selective``) runs under ``torch.utils.checkpoint`` on its
own (``vlmshard.train.recompute``).

Each stage builds and loads only its own layers (``LayerSpec`` builds lazily, per stage). A tied
token embedding / LM head is a ``TiedLayerSpec``: the first and last stages each hold a copy and
DeepSpeed all-reduces their gradients, so they stay one weight.

A stage's ``forward`` slices the padded tuple it receives to the real tiles and tokens once
(``vlmshard.train.micro.from_wire``, with the micro-batch's ``HostMeta`` the trainer gave the
stage for the step: ``expect``), runs its layers on the real rows only, and pads its output
back to the static shapes the next stage expects. The last stage returns the micro-batch's
summed loss.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

from vlmshard.errors import ConfigError
from vlmshard.recipe import Recipe

from . import deepspeed_compat as ds
from .clock import StageClock, layer_part
from .hf_model import ModelLayers, model_layers
from .kernels import Kernels, compiles_inside
from .micro import HostMeta, Micro, from_wire, to_wire, wire_inputs
from .models.layers import LayerDef
from .recompute import run_layer
from .trace import annotated

if TYPE_CHECKING:
    from .topology import Topology


class PipeLayer(nn.Module):
    """One layer of the model folder, built on meta and loaded with its own tensors only,
    straight onto the stage's device (what a DeepSpeed ``LayerSpec`` builds on the stage that
    holds it)."""

    def __init__(self, path: str, index: int, backend: str, kernels: Kernels, recipe: Recipe,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.inner = model_layers(path, backend, kernels, recipe).build_layer(index, device,
                                                                              dtype)

    @property
    def weight(self) -> torch.Tensor:  # the tied embedding's, for DeepSpeed's tie
        return self.inner.weight

    def forward(self, micro: Micro) -> torch.Tensor:
        return self.inner(micro)


def recompute_modes(names: list[str], recompute: set[str], selective: set[str],
                    model: ModelLayers) -> list[str | None]:
    """Per layer of ``names``, how it is recomputed (``vlmshard.train.recompute``): ``no_grad``
    where the recipe runs it forward only (frozen, nothing trained before it: there is no
    backward to keep anything for), else ``full`` where named in ``recompute``, else
    ``selective`` where named there, else not at all."""
    unknown = (set(recompute) | set(selective)) - set(model.names)
    if unknown:
        raise ConfigError(f"recompute names {sorted(unknown)} are not layers of {model.path} "
                          f"({', '.join(model.names)})")
    runs = dict(zip(model.names, model.modes))
    return ["no_grad" if runs[n] == "forward" else "full" if n in recompute
            else "selective" if n in selective else None for n in names]


def run_layers(layers: list[nn.Module], defs: list[LayerDef], micro: Micro,
               modes: list[str | None], clock: StageClock | None = None) -> Micro:
    """The layers in order on one micro-batch, each recomputed in backward as its mode says
    (``recompute_modes``). Each returns its output rows (the loss, for the head), or a
    ``LayerOutput`` when it also makes or uses carried features. ``clock``: each run of
    consecutive layers of one part (``clock.PARTS``) is timed on it, forward, backward (up to the
    last layer's, which the caller times with the stage's output) and recompute (the caller
    marks the forward's start: ``StageClock.forward_begin``)."""
    parts = [layer_part(d.name) for d in defs]
    for i, (layer, d, mode) in enumerate(zip(layers, defs, modes)):
        compiled = compiles_inside(layer)
        layer = annotated(d.name, layer)
        if clock is not None and mode in ("full", "selective"):
            layer = clock.recomputed(parts[i], layer)
        micro = micro.with_output(run_layer(layer, micro, mode, compiled), d.output)
        if clock is not None and (i + 1 == len(parts) or parts[i + 1] != parts[i]):
            clock.forward_part(parts[i])
            if i + 1 < len(parts) and micro.x.requires_grad:
                micro.x.register_hook(clock.part_grad_arrives(parts[i]))
    return micro


class VLMPipeline(PipelineModule):
    """``PipelineModule`` over a model folder's layers. ``bounds``: stage s holds layers
    ``bounds[s]:bounds[s + 1]`` (None: DeepSpeed's ``parameters`` method); ``dtype`` and
    ``device``: the weights' (each stage loads its tensors straight into them); ``clock``: the
    engine's, which the stage's forwards and backwards mark; ``topology``: the run's, whose
    layout DeepSpeed's engine takes and whose groups a sequence-parallel share exchanges over."""

    def __init__(self, model: ModelLayers, stages: int, loss_fn, *, clock: StageClock,
                 backend: str, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", bounds: list[int] | None = None,
                 recompute: set[str] = frozenset(), selective: set[str] = frozenset(),
                 topology: Topology | None = None, **kwargs) -> None:
        recompute_modes([], recompute, selective, model)  # unknown names fail before building
        ds.check_compatible()
        self._vlmshard_bounds = bounds
        self.model = model
        self.backend = backend
        specs = []
        for i, d in enumerate(model.defs):
            args = (model.path, i, backend, model.kernels, model.recipe, dtype, device)
            if d.tied_key:
                specs.append(TiedLayerSpec(d.tied_key, PipeLayer, *args))
            else:
                specs.append(LayerSpec(PipeLayer, *args))
        super().__init__(layers=specs, num_stages=stages, loss_fn=loss_fn,
                         partition_method="bounds" if bounds else "parameters",
                         topology=topology.deepspeed() if topology else None, **kwargs)
        self.run_topology = topology
        self.layer_indices = ds.local_layers(self)
        self._hosts: deque[HostMeta] = deque()
        self.recompute = recompute_modes(self.stage_layer_names, recompute, selective, model)
        self.clock = clock
        clock.watch(p for p in self.parameters() if p.requires_grad)

    def _partition_layers(self, method: str = "uniform") -> None:
        if method != "bounds":
            return super()._partition_layers(method)
        bounds, layers = list(self._vlmshard_bounds), ds.layer_count(self)
        if len(bounds) != self.num_stages + 1 or bounds[0] != 0 or bounds[-1] != layers or any(
                a >= b for a, b in zip(bounds, bounds[1:])):
            raise ConfigError(f"stage bounds {bounds} do not split {layers} layers into "
                              f"{self.num_stages} non-empty stages")
        ds.set_stage_bounds(self, bounds)

    def get_tied_weights_and_groups(self):
        """DeepSpeed's tied weights whose gradients its engine all-reduces between the stages
        holding them: a frozen one (an embedding --freeze-embeddings or LoRA leaves frozen) has
        none, and its bf16 optimizer gives it no gradient buffer to read."""
        return [(w, g) for w, g in super().get_tied_weights_and_groups() if w.requires_grad]

    @property
    def stage_layer_names(self) -> list[str]:
        return [self.model.names[i] for i in self.layer_indices]

    def expect(self, hosts: list[HostMeta]) -> None:
        """The sizes of the step's micro-batches, in order: DeepSpeed's schedule runs each
        stage's forwards in micro-batch order, once each."""
        if self._hosts:
            raise RuntimeError(f"{len(self._hosts)} micro-batches of the last step never ran")
        self._hosts.extend(hosts)

    def forward(self, wire: tuple):
        self.clock.forward_begin()
        first = self.layer_indices[0]
        if not self.model.input_needs_grad(first):
            # DeepSpeed makes the float inputs require grad; pixels, and what a frozen stage
            # before this one made, need none (and ``skip_frozen_gradients`` sends none back)
            wire = tuple(t.detach() for t in wire)
        elif wire[0].requires_grad:
            self.clock.watch_input(wire[0])
        if not self._hosts:
            raise RuntimeError("a forward with no HostMeta: give the step's with expect() "
                               "before train_batch")
        micro = from_wire(wire, self._hosts.popleft(), self.model.input_phase(first),
                          self.backend, self.run_topology)
        defs = [self.model.defs[i] for i in self.layer_indices]
        micro = run_layers(ds.stage_functions(self), defs, micro, self.recompute, self.clock)
        last = self.layer_indices[-1]
        part = layer_part(defs[-1].name)
        if last == len(self.model.defs) - 1:
            out = activation = micro.x  # the loss
        else:
            out = to_wire(micro, self.model.defs[last].output,
                          self.model.geometry.tokens_per_tile)
            activation = out[0]
            if activation.requires_grad:
                # DeepSpeed runs a backward from every floating output the next stage returns a
                # gradient for: one a frozen part made (DeepStack features of a frozen ViT beside
                # a trained LLM layer) takes its gradient as a leaf and passes it nowhere
                out = tuple(t.requires_grad_() if t.is_floating_point() else t for t in out)
            self.clock.forward_part(part)  # the packing, with the stage's last part
        if activation.requires_grad:
            activation.register_hook(self.clock.output_grad_arrives(part))
        return out


class AveTokenLoss:
    """DeepSpeed's ``loss_fn``: the micro-batch's summed loss over the step's global count of
    supervised tokens (HBP's Ave-Token), so packing does not change the gradient.

    DeepSpeed divides each micro-batch's loss by the gradient-accumulation steps and averages
    gradients over data-parallel ranks; ``scale`` = GAS × DP undoes both, and the loss DeepSpeed
    reports is then exactly the per-token mean over the global batch. A term the HF model adds
    to each forward's loss (a MoE router's auxiliary loss, the head's second output) is added
    as it is: DeepSpeed's division then makes it the mean over micro-batches, as HF Trainer's
    gradient accumulation does.
    """

    def __init__(self) -> None:
        self.scale = 1.0
        self.global_tokens = 1

    def __call__(self, loss_sum: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if loss_sum.dim():  # [summed loss, terms HF adds per forward: a MoE router's aux loss]
            return loss_sum[0] * (self.scale / max(1, self.global_tokens)) + loss_sum[1:].sum()
        return loss_sum * (self.scale / max(1, self.global_tokens))


def pipeline_inputs(batch: dict, device: torch.device | str = "cpu") -> tuple[tuple, torch.Tensor]:
    """A collated micro-batch (``vlmshard.shards.loader``) as DeepSpeed's (inputs, labels) pair
    on the stage's device (an asynchronous copy from the loader's pinned memory on GPU)."""
    wire = tuple(t.to(device, non_blocking=True) for t in wire_inputs(batch))
    return wire, wire[3]


def no_inputs() -> tuple[tuple, torch.Tensor]:
    """What a stage that reads no data gives DeepSpeed's loader: its inputs come from the
    previous stage, and the last stage's head takes the labels off the wire, not from here."""
    return (), torch.zeros(1)
