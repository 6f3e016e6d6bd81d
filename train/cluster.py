"""Where the training processes run: one node, every node from a DeepSpeed hostfile, or this
node's share of a job started on every node (torchrun-style variables, or SLURM's).

The same ``vlmshard train`` command then runs anywhere: on one machine as it is; under
``srun`` or a torchrun-style scheduler once per node; with ``--hostfile`` once, from node 0,
with DeepSpeed's own multi-node runner (pdsh over passwordless ssh).
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from typing import Mapping

from vlmshard.config import ConfigError

DEFAULT_PORT = 29500  # torch.distributed's and DeepSpeed's default: node 0's port on many nodes


@dataclass(frozen=True)
class Cluster:
    """The node layout of one training job.

    ``nodes`` × ``procs_per_node`` = PP × DP. ``hostfile`` set: DeepSpeed's runner starts every
    node from this one. Otherwise this process starts node ``node_rank``'s processes only."""

    nodes: int
    node_rank: int
    procs_per_node: int
    master_addr: str
    master_port: int
    hostfile: str | None = None

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @classmethod
    def resolve(cls, processes: int, env: Mapping[str, str], *, hostfile: str | None = None,
                master_port: int | None = None) -> "Cluster":
        """The layout for ``processes`` ranks from the options and the environment.

        Multi-node variables, first found wins: torchrun's ``NNODES``, ``NODE_RANK``,
        ``NPROC_PER_NODE``, ``MASTER_ADDR``, ``MASTER_PORT``; then SLURM's ``SLURM_NNODES``,
        ``SLURM_NODEID`` and ``SLURM_JOB_NODELIST`` (its first host is the master).

        The rendezvous port is ``master_port``, else ``MASTER_PORT``; with neither, a job on one
        node takes a free port the system gives it (as ``torchrun --standalone`` does: another
        job on 29500 is no matter), and a job on several nodes 29500, which every node knows."""
        given = master_port or (int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else None)
        port = given or DEFAULT_PORT
        if hostfile:
            slots = hostfile_slots(hostfile)
            if sum(slots.values()) < processes:
                raise ConfigError(f"{hostfile} lists {sum(slots.values())} slots for "
                                  f"{processes} processes (PP × DP)")
            return cls(nodes=len(slots), node_rank=0, procs_per_node=max(slots.values()),
                       master_addr=env.get("MASTER_ADDR", ""), master_port=port,
                       hostfile=hostfile)
        if env.get("NNODES") or env.get("NODE_RANK"):
            nodes, node_rank = int(env.get("NNODES") or 1), int(env.get("NODE_RANK") or 0)
            master = env.get("MASTER_ADDR", "")
            source = "NNODES/NODE_RANK"
        elif int(env.get("SLURM_NNODES") or 1) > 1:
            nodes, node_rank = int(env["SLURM_NNODES"]), int(env.get("SLURM_NODEID") or 0)
            master = env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_JOB_NODELIST", ""))
            source = "SLURM_NNODES/SLURM_NODEID"
        else:
            return cls(nodes=1, node_rank=0, procs_per_node=processes, master_addr="127.0.0.1",
                       master_port=given or free_port())
        if not 0 <= node_rank < nodes:
            raise ConfigError(f"node rank {node_rank} is outside {nodes} nodes ({source})")
        if nodes > 1 and not master:
            raise ConfigError(f"{nodes} nodes ({source}) but no MASTER_ADDR: set it to node 0's "
                              "address")
        per_node = int(env.get("NPROC_PER_NODE") or 0) or processes // nodes
        if per_node * nodes != processes:
            raise ConfigError(f"{nodes} nodes × {per_node} processes per node ≠ {processes} "
                              "processes (PP × DP); set NPROC_PER_NODE or change --pp/--dp")
        return cls(nodes=nodes, node_rank=node_rank, procs_per_node=per_node,
                   master_addr=master or "127.0.0.1",
                   master_port=port if given or nodes > 1 else free_port())

    def world_info(self, visible_devices: str | None = None) -> dict[str, list[int | str]]:
        """DeepSpeed's per-node launcher's view: node name → local device slots, in node order.

        The launcher sets each process's ``CUDA_VISIBLE_DEVICES`` from these slots, so a
        scheduler's own (``visible_devices``, e.g. ``4,5`` of an 8-GPU node) are the slots, not
        0..n-1 (which would move the job onto GPUs another job holds)."""
        given = [s.strip() for s in (visible_devices or "").split(",") if s.strip()]
        slots = ([int(s) if s.isdigit() else s for s in given[:self.procs_per_node]]
                 if len(given) >= self.procs_per_node else list(range(self.procs_per_node)))
        return {f"node{i}": slots for i in range(self.nodes)}

    def check_devices(self, visible: int, visible_devices: str | None = None) -> None:
        """One line, before any process starts, when this node shows fewer GPUs than it runs
        processes (each process takes one): not "invalid device ordinal" from every rank."""
        if visible < self.procs_per_node:
            shown = f" (CUDA_VISIBLE_DEVICES={visible_devices})" if visible_devices else ""
            raise ConfigError(f"{self.procs_per_node} training processes on this node (PP × DP"
                              f"{' / nodes' if self.nodes > 1 else ''}) need as many GPUs; it "
                              f"shows {visible}{shown}: lower --pp/--dp or add nodes")

    def check_port(self) -> None:
        """On node 0, a one-line error when the rendezvous port is taken (another job holds it),
        rather than a hang or a traceback from every process."""
        if self.node_rank != 0 or self.hostfile:
            return
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                # every address, as the rendezvous store listens: a port another job holds on
                # another address of this host fails there too
                s.bind(("", self.master_port))
            except OSError as e:
                raise ConfigError(f"port {self.master_port} is in use ({e.strerror}): another "
                                  "job's rendezvous? Pass another --master-port or MASTER_PORT"
                                  f"{'' if self.nodes > 1 else ', or neither to take a free one'}"
                                  ) from e


def free_port() -> int:
    """A TCP port free on every address of this host now: the one the system gives a socket
    bound to port 0 (``torchrun --standalone``'s way; the socket is closed before the job's
    rendezvous binds it)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def hostfile_slots(path: str) -> dict[str, int]:
    """DeepSpeed's hostfile: ``HOST slots=N`` per line, ``#`` comments."""
    slots = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            match = re.fullmatch(r"(\S+)\s+slots=(\d+)", line)
            if not match:
                raise ConfigError(f"{path}:{number}: expected 'HOST slots=N', got {line!r}")
            slots[match.group(1)] = int(match.group(2))
    if not slots:
        raise ConfigError(f"{path}: no hosts")
    return slots


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu[03-05,9],cpu1`` → ``gpu03``."""
    match = re.match(r"([^\[,]+)(?:\[([^\],-]+))?", nodelist)
    return (match.group(1) + (match.group(2) or "")) if match else ""
