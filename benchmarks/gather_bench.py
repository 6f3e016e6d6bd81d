"""The bytes a training step moves so that rank 0 can log every rank's timings: gathered to
every rank (``all_gather_object``) against gathered to rank 0 alone (``gather_object``, what
``vlmshard.train.distributed.to_rank_0`` does), on as many gloo CPU ranks as the run had.

    python benchmarks/gather_bench.py RUN/train

RUN/train: a ``vlmshard train`` run's folder. Each step's record in its ``train_log.jsonl``
gives back what every rank sent (``train_log.step_record`` keeps each rank's timings and each
first stage's data). Each rank sends it again with both collectives, in processes of one gloo
world; the bytes are counted where torch's object collectives move them (its ``all_gather`` of
the pickled sizes and of the padded pickles, its ``gather`` of them): every byte a rank receives
from another, summed over the ranks, per step.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import socket
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import distributed_c10d as c10d


def sent(record: dict) -> list[dict]:
    """What each rank sent for this step, in rank order (``trainer.run_steps``)."""
    data = {d["dp_rank"]: {k: v for k, v in d.items() if k != "dp_rank"} for d in record["data"]}
    return [{**r, "data": data[r["dp_rank"]]} if r["stage"] == 0 and r["dp_rank"] in data
            else dict(r) for r in record["ranks"]]


ALL_GATHER, GATHER = c10d.all_gather, c10d.gather  # torch's, as the object collectives call them


def counted(collective, received: dict):
    """``collective`` (torch's all_gather or gather) adding to ``received`` the bytes of every
    output slot but this rank's own: the pickled sizes (int64) apart from the pickles (uint8)."""
    def run(*args, **kwargs):
        outputs = args[0] if collective is ALL_GATHER else kwargs.get("gather_list")
        for i, t in enumerate(outputs or []):
            if i != dist.get_rank():
                kind = "sizes" if t.dtype == torch.long else "pickles"
                received[kind] += t.numel() * t.element_size()
        return collective(*args, **kwargs)
    return run


def rank(me: int, world: int, port: int, steps: list[list[dict]], out: str) -> None:
    """One rank: each step's timings sent both ways, the bytes it received written to
    ``out.RANK``."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=me,
                            world_size=world)
    ways = {}
    for way in ("all_gather_object", "gather_object"):
        ways[way] = []
        for ranks in steps:
            received = {"sizes": 0, "pickles": 0}
            c10d.all_gather, c10d.gather = counted(ALL_GATHER, received), counted(GATHER, received)
            try:
                if way == "all_gather_object":
                    dist.all_gather_object([None] * world, ranks[me])
                else:
                    dist.gather_object(ranks[me], [None] * world if me == 0 else None, dst=0)
            finally:
                c10d.all_gather, c10d.gather = ALL_GATHER, GATHER
            ways[way].append(received)
    with open(f"{out}.{me}", "w", encoding="utf-8") as f:
        json.dump(ways, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(prog="gather_bench.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a vlmshard train run folder (its train_log.jsonl)")
    args = parser.parse_args()
    with open(os.path.join(args.run, "train_log.jsonl"), encoding="utf-8") as f:
        steps = [sent(json.loads(line)) for line in f]
    world = len(steps[0])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(args.run, "gather_bench")
    mp.spawn(rank, args=(world, port, steps, out), nprocs=world)
    counts = []
    for me in range(world):
        with open(f"{out}.{me}", encoding="utf-8") as f:
            counts.append(json.load(f))
        os.remove(f"{out}.{me}")
    pickled = statistics.mean(len(pickle.dumps(r)) for ranks in steps for r in ranks)
    print(f"{world} ranks, {len(steps)} steps; a rank's timings pickle to {pickled:.0f} bytes "
          "(mean)")
    for way in ("all_gather_object", "gather_object"):
        step = {kind: statistics.mean(sum(c[way][i][kind] for c in counts)
                                      for i in range(len(steps)))
                for kind in ("pickles", "sizes")}
        print(f"{way:>18}: {step['pickles']:>9.0f} bytes received a step, over all ranks "
              f"(+ {step['sizes']:.0f} for the pickles' sizes)")


if __name__ == "__main__":
    main()
