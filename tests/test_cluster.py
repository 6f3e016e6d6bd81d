"""The node layout ``vlmshard train`` reads from its options and the scheduler's environment."""

from __future__ import annotations

import base64
import json
import socket

import pytest

from vlmshard.config import ConfigError
from vlmshard.train.cluster import Cluster, first_slurm_host
from vlmshard.train.launcher import launcher_command


def test_one_node_by_default():
    c = Cluster.resolve(4, {})
    assert (c.nodes, c.node_rank, c.procs_per_node, c.master_addr) == (1, 0, 4, "127.0.0.1")
    assert Cluster.resolve(4, {"MASTER_PORT": "31000"}).master_port == 31000
    assert Cluster.resolve(4, {"MASTER_PORT": "31000"}, master_port=32000).master_port == 32000


def test_torchrun_style_variables_give_this_nodes_share():
    env = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29511"}
    c = Cluster.resolve(8, env)
    assert (c.nodes, c.node_rank, c.procs_per_node, c.master_addr, c.master_port) == (
        2, 1, 4, "10.0.0.7", 29511)
    cmd = launcher_command(c)
    world = next(a for a in cmd if a.startswith("--world_info="))
    # DeepSpeed's launcher numbers node 1's ranks after node 0's four
    assert json.loads(base64.urlsafe_b64decode(world.split("=", 1)[1])) == {
        "node0": [0, 1, 2, 3], "node1": [0, 1, 2, 3]}
    assert "--node_rank=1" in cmd and "--master_addr=10.0.0.7" in cmd


def test_slurm_variables():
    env = {"SLURM_NNODES": "3", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[07-09]"}
    c = Cluster.resolve(6, env)
    assert (c.nodes, c.node_rank, c.procs_per_node, c.master_addr) == (3, 2, 2, "gpu07")
    assert first_slurm_host("a1,b[2-3]") == "a1" and first_slurm_host("n[5,9]") == "n5"


@pytest.mark.parametrize("env, message", [
    ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "h"}, "node rank 2 is outside 2 nodes"),
    ({"NNODES": "2", "NODE_RANK": "0"}, "no MASTER_ADDR"),
    ({"NNODES": "3", "NODE_RANK": "0", "MASTER_ADDR": "h"}, "3 nodes × 1 processes per node"),
    ({"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "h", "NPROC_PER_NODE": "3"},
     "2 nodes × 3 processes per node ≠ 4"),
])
def test_inconsistent_layouts_are_one_line(env, message):
    with pytest.raises(ConfigError, match=message):
        Cluster.resolve(4, env)


def test_hostfile(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("# two nodes\nworker-0 slots=4\nworker-1 slots=4  # spare\n")
    c = Cluster.resolve(8, {}, hostfile=str(path))
    assert (c.nodes, c.procs_per_node, c.hostfile) == (2, 4, str(path))
    assert launcher_command(c)[2:5] == ["deepspeed.launcher.runner", "--hostfile", str(path)]
    with pytest.raises(ConfigError, match="lists 8 slots for 16 processes"):
        Cluster.resolve(16, {}, hostfile=str(path))
    path.write_text("worker-0 4\n")
    with pytest.raises(ConfigError, match="hostfile:1: expected 'HOST slots=N'"):
        Cluster.resolve(4, {}, hostfile=str(path))


def test_a_taken_port_is_one_line():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ConfigError, match=f"port {port} is in use"):
            Cluster.resolve(2, {}, master_port=port).check_port()


def _hold(port: int) -> socket.socket | None:
    """A socket listening on ``port`` (None when another process holds it already)."""
    held = socket.socket()
    try:
        held.bind(("127.0.0.1", port))
        held.listen()
        return held
    except OSError:
        held.close()
        return None


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
            return True
        except OSError:
            return False


def test_one_node_takes_a_free_port_when_none_is_given():
    """Another job on 29500 (the default torch.distributed and DeepSpeed share): a one-node job
    with neither --master-port nor MASTER_PORT takes a port the system gives it, as torchrun
    --standalone does, instead of failing in DeepSpeed's rendezvous."""
    held = _hold(29500)  # None: another process on this host holds it already
    try:
        for env in ({}, {"NNODES": "1", "NODE_RANK": "0"}):
            c = Cluster.resolve(4, env)
            assert c.master_port != 29500 and 1024 < c.master_port < 65536
            assert _free(c.master_port)
            c.check_port()  # the port it took passes the up-front check
            assert f"--master_port={c.master_port}" in launcher_command(c)
        # given ports are kept, taken or not (the check says so); several nodes keep 29500
        assert Cluster.resolve(4, {"MASTER_PORT": "29500"}).master_port == 29500
        assert Cluster.resolve(4, {}, master_port=29500).master_port == 29500
        env = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.7"}
        assert Cluster.resolve(4, env).master_port == 29500
    finally:
        if held is not None:
            held.close()
    # an explicit port that is taken is still refused up front, in one line
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for cluster in (Cluster.resolve(4, {}, master_port=port),
                        Cluster.resolve(4, {"MASTER_PORT": str(port)})):
            with pytest.raises(ConfigError) as e:
                cluster.check_port()
            assert str(e.value) == (f"port {port} is in use (Address already in use): another "
                                    "job's rendezvous? Pass another --master-port or "
                                    "MASTER_PORT, or neither to take a free one")


def _world(cmd: list[str]) -> dict:
    world = next(a for a in cmd if a.startswith("--world_info="))
    return json.loads(base64.urlsafe_b64decode(world.split("=", 1)[1]))


def test_a_schedulers_gpus_are_kept_and_too_few_are_one_line():
    """DeepSpeed's launcher sets each rank's CUDA_VISIBLE_DEVICES from the world_info slots: a
    scheduler's own GPUs stay the job's; a node with fewer GPUs than processes stops at once."""
    c = Cluster.resolve(2, {})
    assert _world(launcher_command(c, "4,5,6")) == {"node0": [4, 5]}
    assert _world(launcher_command(c, "GPU-a1,GPU-b2")) == {"node0": ["GPU-a1", "GPU-b2"]}
    assert _world(launcher_command(c)) == {"node0": [0, 1]}
    c.check_devices(2)
    with pytest.raises(ConfigError, match=r"^2 training processes on this node \(PP × DP\) need "
                                          r"as many GPUs; it shows 1 \(CUDA_VISIBLE_DEVICES=3\)"):
        c.check_devices(1, "3")
