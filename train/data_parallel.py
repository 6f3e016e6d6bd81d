"""Data parallelism alone (``--pp 1``) under ZeRO-2 or ZeRO-3: DeepSpeed's plain engine over the
model folder's layers in one module, on the same shards, layers, loss and log as the pipeline.

DeepSpeed's pipeline engine takes ZeRO-1 only. At one stage there is no pipeline to keep, so a
run that wants its gradients (ZeRO-2) or also its parameters (ZeRO-3) sharded over the DP ranks
takes the plain engine: per micro-batch a forward, ``engine.backward`` and ``engine.step``, which
steps the optimizer at the gradient-accumulation boundary, after the step's micro-batches, as the
pipeline does. Each rank builds and loads the whole model once, then ZeRO-3 partitions it: the
model's weights must fit one device before training (its gradients and optimizer states never
need to).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from .clock import StageClock
from .hf_model import ModelLayers
from .micro import HostMeta, from_wire
from .pipeline import recompute_modes, run_layers

if TYPE_CHECKING:
    from .topology import Topology


class VLMModel(nn.Module):
    """Every layer of a model folder in one module, run in order on one micro-batch; returns the
    loss ``loss_fn`` makes of the head's output and the labels."""

    def __init__(self, model: ModelLayers, loss_fn, *, device: torch.device | str,
                 dtype: torch.dtype, recompute: set[str] = frozenset(),
                 selective: set[str] = frozenset(), clock: StageClock | None = None,
                 topology: Topology | None = None) -> None:
        super().__init__()
        built = model.build_all(device, dtype)  # a tied head is the embedding's module
        self.layers = nn.ModuleList({id(m): m for m in built}.values())  # each module once
        self.ordered = built  # a plain list: the layers in pipeline order, not registered again
        self.model = model
        self.loss_fn = loss_fn
        self.recompute = recompute_modes(model.names, recompute, selective, model)
        self.clock = clock  # the engine's, which its layers' forwards mark
        self.topology = topology  # a sequence-parallel share's groups

    @property
    def stage_layer_names(self) -> list[str]:
        return list(self.model.names)

    def forward(self, wire: tuple, host: HostMeta) -> torch.Tensor:
        micro = from_wire(wire, host, self.model.input_phase(0), self.model.backend,
                          self.topology)
        micro = run_layers(self.ordered, self.model.defs, micro, self.recompute, self.clock)
        return self.loss_fn(micro.x, wire[3])

    def register_external_weights(self) -> None:
        """For ZeRO-3: a layer that reads a weight outside the submodule holding it (the LM head
        computes its logits from the weight, chunk by chunk) declares it, so DeepSpeed gathers
        it whenever the layer runs."""
        import deepspeed

        for layer in self.layers:
            weight = getattr(type(layer), "weight", None)
            if isinstance(weight, property):
                deepspeed.zero.register_external_parameter(layer, layer.weight)


def train_batch(engine, clock: StageClock, inputs: list[tuple], hosts: list[HostMeta]
                ) -> torch.Tensor:
    """One step of the plan's micro-batches, each timed on ``clock``; the loss the pipeline
    engine would report (the mean over micro-batches, averaged over the DP ranks: every rank is
    one)."""
    total = torch.zeros((), device=engine.device)
    for (wire, _), host in zip(inputs, hosts):
        clock.forward_begin()
        loss = engine(wire, host)
        clock.forward_part("head")  # the loss
        clock.backward_begin("head")
        engine.backward(loss)
        clock.backward_done()
        engine.step()
        total += loss.detach().float()
    torch.distributed.all_reduce(total)
    return total / (len(inputs) * torch.distributed.get_world_size())
