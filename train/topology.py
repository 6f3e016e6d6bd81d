"""Every process group of a training run, made once from ``DeviceMesh``es of one layout and
passed to whoever needs one.

A rank is ``stage × dp + dp_rank``, the numbering DeepSpeed's ``PipeDataParallelTopology``
uses, so the pipeline engine's own groups (built from ``Topology.deepspeed``) and these agree.
A sequence-parallel degree s splits the data-parallel dim into (dp/s, s): its groups are s
consecutive ranks of one stage. The host's groups (a micro-batch's sizes, token counts,
timings, one decision for all) are gloo on every device, so that what the host knows never
touches the GPU; the sequence-parallel exchanges run on the device's backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from vlmshard.errors import ConfigError

if TYPE_CHECKING:
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology


@dataclass(frozen=True)
class Topology:
    """The layout of PP × DP ranks and this rank's groups in it."""

    pp: int
    dp: int
    host: DeviceMesh  # gloo, dims ("pp", "dp"): along "pp", one data-parallel rank's pipeline
    world: dist.ProcessGroup  # gloo, every rank
    sequence: dict[int, DeviceMesh]  # per degree s > 1: ("pp", "dp", "sp"), (pp, dp/s, s)

    @classmethod
    def build(cls, pp: int, dp: int, degrees=(), device_type: str = "cpu") -> Topology:
        """Every group, on every rank in the same order (making a group is collective):
        ``degrees`` the sequence-parallel degrees the shards use, ``device_type`` the device
        the exchanges run on ("cpu" or "cuda")."""
        world = dist.get_world_size()
        if pp * dp != world:
            raise ConfigError(f"--pp {pp} × --dp {dp} is not the {world} processes started")
        for sp in degrees:
            if dp % sp:
                raise ConfigError(f"sequence-parallel degree {sp} does not divide --dp {dp}")
        host = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"),
                                backend_override={"pp": "gloo", "dp": "gloo"})
        every = init_device_mesh("cpu", (world,), mesh_dim_names=("world",),
                                 backend_override={"world": "gloo"}).get_group()
        sequence = {sp: init_device_mesh(device_type, (pp, dp // sp, sp),
                                         mesh_dim_names=("pp", "dp", "sp"))
                    for sp in sorted(set(degrees) - {1})}
        for group in (host.get_group("pp"), every):
            if dist.get_backend(group) != "gloo":  # the host's values are CPU objects
                raise RuntimeError(f"a host group took {dist.get_backend(group)}, not gloo")
        return cls(pp, dp, host, every, sequence)

    @property
    def stage(self) -> int:
        return self.host.get_coordinate()[0]

    @property
    def dp_rank(self) -> int:
        return self.host.get_coordinate()[1]

    @property
    def pipeline(self) -> dist.ProcessGroup:
        """This rank's pipeline (gloo): its stages, one rank each."""
        return self.host.get_group("pp")

    @property
    def pipeline_first(self) -> int:
        """The global rank of this pipeline's first stage, which reads the data."""
        return int(self.host.mesh[0, self.dp_rank])

    def sequence_group(self, sp: int) -> dist.ProcessGroup:
        """This rank's group of ``sp`` ranks sharing a micro-batch."""
        if sp not in self.sequence:
            raise RuntimeError(f"no sequence-parallel group of {sp} ranks: the topology was "
                               f"built for degrees {sorted(self.sequence) or 'none'}")
        return self.sequence[sp].get_group("sp")

    def deepspeed(self) -> PipeDataParallelTopology:
        """The same layout as DeepSpeed's pipeline engine takes it, every rank checked to sit
        where the mesh puts it (the engine builds its own groups from this)."""
        from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

        topology = PipeDataParallelTopology(num_pp=self.pp, num_dp=self.dp)
        for stage, ranks in enumerate(self.host.mesh.tolist()):
            for dp_rank, rank in enumerate(ranks):
                if topology.get_rank(pipe=stage, data=dp_rank) != rank:
                    raise RuntimeError(f"DeepSpeed puts (stage {stage}, dp rank {dp_rank}) at "
                                       f"rank {topology.get_rank(pipe=stage, data=dp_rank)}, "
                                       f"the mesh at {rank}")
        return topology
