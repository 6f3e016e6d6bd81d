"""Fault injection at counts the test suite cannot afford: how each fault kind ends.

    python benchmarks/faults_bench.py --kills 10 --json build/bench/faults.json   # ~30 minutes

Every fault is injected for real on this machine, on the demo dataset and the tiny InternVL
folder, and every run is judged against a clean run of the same command:

- ``kill -9`` of ``preprocess`` and ``write`` after a random number of their units (parts,
  shards) is committed, and of ``train`` (launcher and stage processes together) at a random
  moment of the clean run's duration; then the same command again (``train --resume`` when a
  checkpoint exists):
  byte-identical outputs, or for train the same losses step by step;
- a part file torn (truncated) behind an interrupted preprocess job's back, then a rerun;
- two ``write`` jobs started together on one folder;
- a full disk (a tmpfs smaller than the output, at a random size), then a rerun with space;
- a loopback HTTP server dropping 20% of requests (503, reset, body cut halfway) and stalling
  5%, for preprocess (annotations and images) and for the shard loader.

Per trial (one fault injected, then the same command again where the fault stopped it): did the
faulted run end in a ``clear error`` (non-zero exit, a one-line message, nothing reported done;
a kill -9 gives no error to judge), and is the final output ``identical`` to the clean run's
(bytes, or for train the losses step by step)? ``lost`` counts the clean run's rows, records or
steps missing from the final outputs (it must be 0).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))

from helpers import kill_9_when, serve_http, tree_bytes, vlmshard  # noqa: E402


@dataclass
class Outcome:
    """How the runs of one fault kind ended."""

    kind: str
    trials: int = 0
    faults: dict[str, int] = field(default_factory=dict)  # injected, per fault
    clear_error: int = 0  # faulted runs that ended in a one-line error, nothing done
    identical: int = 0  # trials whose final output is the clean run's
    lost: int = 0
    notes: list[str] = field(default_factory=list)

    def add_faults(self, counts: dict[str, int]) -> None:
        for k, v in counts.items():
            self.faults[k] = self.faults.get(k, 0) + v


def timed(*args: str) -> float:
    start = time.monotonic()
    vlmshard(*args)
    return time.monotonic() - start


def rows_of(out: str) -> set[tuple]:
    """(source, row) of every input row a preprocess output accounts for."""
    import pyarrow.parquet as pq

    if not os.path.exists(os.path.join(out, "preprocess.json")):
        return set()
    stats = pq.read_table(os.path.join(out, "stats"), columns=["source", "row"]).to_pylist()
    rejects = pq.read_table(os.path.join(out, "rejects.parquet"),
                            columns=["source", "row"]).to_pylist()
    return {(r["source"], r["row"]) for r in stats + rejects}


def records_of(out: str) -> set[tuple]:
    """(rank, first step, records) of every shard a finished write lists."""
    path = os.path.join(out, "manifest.json")
    if not os.path.exists(path):
        return set()
    with open(path) as f:
        return {(s["rank"], s["first_step"], s["records"]) for s in json.load(f)["shards"]}


def losses_of(out: str) -> dict[int, float]:
    path = os.path.join(out, "train_log.jsonl")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def judge_bytes(outcome: Outcome, out: str, reference: str, items) -> None:
    """One trial's final output against the clean run's."""
    outcome.trials += 1
    outcome.identical += tree_bytes(out) == tree_bytes(reference)
    outcome.lost += len(items(reference) - items(out))


def kill_and_rerun(outcome: Outcome, work: str, stage: str, args: list[str], reference: str,
                   kills: int, rng: random.Random, items) -> None:
    """Kill -9 at random moments of the job's progress: once a random number of its units
    (parts, or shards) is committed, from none to all but one."""
    done = {"preprocess": "preprocess.json", "write": "manifest.json"}[stage]
    pattern = {"preprocess": os.path.join("_work", "parts", "part-*.json"),
               "write": os.path.join("_work", "done", "*.json")}[stage]
    units = {"preprocess":
             lambda: len(json.load(open(os.path.join(reference, done)))["stats_files"]),
             "write": lambda: len(records_of(reference))}[stage]()
    for i in range(kills):
        out = os.path.join(work, f"{stage}-kill-{i}")
        at = rng.randrange(units)
        kill_9_when(stage, *args, "--out", out,
                    ready=lambda: len(glob.glob(os.path.join(out, pattern))) >= at)
        if os.path.exists(os.path.join(out, done)):
            outcome.notes.append(f"run {i}: finished before its kill after {at} units")
        outcome.add_faults({"kill -9": 1})
        vlmshard(stage, *args, "--out", out)
        judge_bytes(outcome, out, reference, items)
        shutil.rmtree(out)


def torn_parts(outcome: Outcome, work: str, args: list[str], reference: str, runs: int,
               rng: random.Random) -> None:
    for i in range(runs):
        out = os.path.join(work, f"torn-{i}")
        parts = os.path.join(out, "_work", "parts")
        committed = lambda: sorted(f for f in os.listdir(parts) if f.endswith(".json")) \
            if os.path.isdir(parts) else []  # noqa: E731
        kill_9_when("preprocess", *args, "--out", out,
                    ready=lambda: len(committed()) >= 2 + i % 3)
        victim = os.path.join(parts, rng.choice(committed()).replace(
            ".json", rng.choice([".stats.parquet", ".rejects.parquet"])))
        with open(victim, "r+b") as f:
            f.truncate(rng.randrange(os.path.getsize(victim)))
        outcome.add_faults({"torn part": 1})
        vlmshard("preprocess", *args, "--out", out)
        judge_bytes(outcome, out, reference, rows_of)
        shutil.rmtree(out)


def concurrent_writes(outcome: Outcome, work: str, args: list[str], reference: str,
                      runs: int) -> None:
    for i in range(runs):
        out = os.path.join(work, f"together-{i}")
        cmd = [sys.executable, "-m", "vlmshard.cli", "write", *args, "--out", out]
        procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for _ in range(2)]
        results = [(p.wait(), p.stderr.read()) for p in procs]
        outcome.add_faults({"second job": 1})
        refused = [err for rc, err in results if rc != 0]
        if len(refused) == 1 and "in use by another vlmshard job" in refused[0]:
            outcome.clear_error += 1
        elif refused:
            outcome.notes.append(f"run {i}: {refused}")
        else:
            outcome.notes.append(f"run {i}: the first job ended before the second started")
        judge_bytes(outcome, out, reference, records_of)
        shutil.rmtree(out)


def full_disks(outcome: Outcome, work: str, stage: str, args: list[str], reference: str,
               runs: int, rng: random.Random, items) -> None:
    needed = sum(len(b) for b in tree_bytes(reference).values())
    disk = os.path.join(work, "disk")
    os.makedirs(disk, exist_ok=True)
    done = {"preprocess": "preprocess.json", "write": "manifest.json"}[stage]
    for i in range(runs):
        size = max(64 * 1024, int(needed * rng.uniform(0.05, 0.8)))
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", disk],
                          capture_output=True).returncode:
            outcome.notes.append("cannot mount a tmpfs here: skipped")
            return
        try:
            out = os.path.join(disk, stage)
            proc = vlmshard(stage, *args, "--out", out, check=False)
            outcome.add_faults({"disk full": 1})
            last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
            if (proc.returncode and "No space left on device" in last
                    and "Traceback" not in proc.stderr
                    and not os.path.exists(os.path.join(out, done))):
                outcome.clear_error += 1
            elif proc.returncode == 0:
                outcome.notes.append(f"run {i}: fit in {size} bytes")
            else:
                outcome.notes.append(f"run {i}: {proc.stderr.strip()[-300:]}")
            subprocess.run(["mount", "-o", f"remount,size={4 * needed + (64 << 20)}", disk],
                           check=True)
            vlmshard(stage, *args, "--out", out)
            judge_bytes(outcome, out, reference, items)
        finally:
            subprocess.run(["umount", "-l", disk], check=False)


def flaky_http(outcome_pre: Outcome, outcome_load: Outcome, work: str, data_root: str,
               pre_reference: str, shards: str, runs: int) -> None:
    import pyarrow.parquet as pq

    from vlmshard.preprocess import PreprocessConfig, run_preprocess
    from vlmshard.shards.loader import ShardDataset

    def comparable(out: str):
        stats = pq.read_table(os.path.join(out, "stats")).drop(["image_paths"]).to_pylist()
        rejects = [(r["source"], r["row"], r["reason"]) for r in
                   pq.read_table(os.path.join(out, "rejects.parquet")).to_pylist()]
        return stats, rejects

    def summary(records):
        return [(r.step, r.rank, r.micro, r.input_ids.tobytes(), tuple(r.images))
                for r in records]

    os.environ.update(VLMSHARD_REMOTE_STALL_S="0.3", VLMSHARD_REMOTE_ATTEMPTS="10",
                      VLMSHARD_REMOTE_WAIT_S="0.05")
    reference = comparable(pre_reference)
    local_records = summary(ShardDataset(shards).records())
    for i in range(runs):
        flaky = {"drop_rate": 0.2, "stall_rate": 0.05, "stall_s": 1.0,
                 "rng": random.Random(i)}
        with serve_http(data_root, injected=(injected := {}), **flaky) as url:
            out = os.path.join(work, f"http-pre-{i}")
            run_preprocess(PreprocessConfig(inputs=[f"{url}/meta.json"], out=out,
                                            max_seq_len=8192, part_size=16, workers=1,
                                            keep_tokens=True))
        outcome_pre.add_faults(injected)
        outcome_pre.trials += 1
        outcome_pre.identical += comparable(out) == reference
        outcome_pre.lost += len(rows_of(pre_reference) - rows_of(out))
        shutil.rmtree(out)
        with serve_http(shards, injected=(injected := {}), **flaky) as url:
            got = summary(ShardDataset(url).records())
        outcome_load.add_faults(injected)
        outcome_load.trials += 1
        outcome_load.identical += got == local_records
        outcome_load.lost += len(set(local_records) - set(got))


def train_kills(outcome: Outcome, work: str, train_args: list[str], kills: int,
                rng: random.Random) -> None:
    reference = os.path.join(work, "train-clean")
    seconds = timed("train", *train_args, "--out", reference)
    expected = losses_of(reference)
    for i in range(kills):
        out = os.path.join(work, f"train-kill-{i}")
        delay = rng.uniform(0.1, 1.0) * seconds
        start = time.monotonic()
        kill_9_when("train", *train_args, "--out", out, session=True, timeout=900,
                    ready=lambda: time.monotonic() - start > delay)
        time.sleep(1)  # the kernel reaps the stage processes
        outcome.add_faults({"kill -9": 1})
        resumable = os.path.exists(os.path.join(out, "checkpoints", "latest"))
        if resumable:
            vlmshard("train", *train_args, "--resume", out)
        else:
            shutil.rmtree(out, ignore_errors=True)
            vlmshard("train", *train_args, "--out", out)
            outcome.notes.append(f"run {i}: killed at {delay:.0f}s before the first checkpoint;"
                                 " started again")
        got = losses_of(out)
        outcome.trials += 1
        outcome.identical += got.keys() == expected.keys() and all(
            abs(got[s] - expected[s]) <= 1e-5 * abs(expected[s]) for s in expected)
        outcome.lost += len(expected.keys() - got.keys())
        shutil.rmtree(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default=os.path.join(REPO, "build", "bench", "faults"))
    p.add_argument("--kills", type=int, default=10, help="kill -9 runs per stage")
    p.add_argument("--runs", type=int, default=3,
                   help="runs of each other fault kind (torn parts, concurrent writes, full "
                        "disks, flaky HTTP)")
    p.add_argument("--train-kills", type=int, default=None,
                   help="kill -9 runs of train (default --kills; 0 skips train)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", type=int, default=3, help="demo dataset scale (longer jobs: more "
                                                        "moments to kill them at)")
    p.add_argument("--json", help="also write the outcomes here")
    args = p.parse_args()
    rng = random.Random(args.seed)

    from vlmshard.demo.data import generate
    from vlmshard.demo.data import demo_model

    work = args.work
    shutil.rmtree(work, ignore_errors=True)
    data = generate(os.path.join(work, "data"), seed=0, scale=args.scale)
    model = demo_model("internvl", os.path.join(work, "model"))
    pre_args = [data.meta, "--part-size", "16", "--workers", "1", "--max-seq-len", "8192",
                "--keep-tokens"]
    pre = os.path.join(work, "pre")
    vlmshard("preprocess", *pre_args, "--out", pre)
    plan = os.path.join(work, "plan")
    vlmshard("pack", "--stats", pre, "--dp", "1", "--micro-batches", "2", "--out", plan)
    write_args = ["--plan", plan, "--stats", pre, "--shard-bytes", "8MB", "--workers", "1"]
    shards = os.path.join(work, "shards")
    vlmshard("write", *write_args, "--out", shards)
    model_pre = os.path.join(work, "model-pre")
    vlmshard("preprocess", data.meta, "--model", model, "--keep-tokens", "--workers", "1",
             "--max-seq-len", "8192", "--out", model_pre)
    vlmshard("pack", "--stats", model_pre, "--dp", "1", "--micro-batches", "2",
             "--target-samples", "4", "--out", os.path.join(work, "model-plan"))
    model_shards = os.path.join(work, "model-shards")
    vlmshard("write", "--plan", os.path.join(work, "model-plan"), "--stats", model_pre,
             "--workers", "1", "--out", model_shards)
    train_args = ["--shards", model_shards, "--pp", "2", "--max-steps", "6",
                  "--checkpoint-every", "2", "--lr", "0.003"]

    outcomes = {k: Outcome(k) for k in (
        "preprocess kill -9", "write kill -9", "train kill -9", "torn part",
        "concurrent write", "preprocess disk full", "write disk full",
        "preprocess over flaky HTTP", "loader over flaky HTTP")}
    kill_and_rerun(outcomes["preprocess kill -9"], work, "preprocess", pre_args, pre,
                   args.kills, rng, rows_of)
    kill_and_rerun(outcomes["write kill -9"], work, "write", write_args, shards, args.kills, rng,
                   records_of)
    torn_parts(outcomes["torn part"], work, pre_args, pre, args.runs, rng)
    concurrent_writes(outcomes["concurrent write"], work, write_args, shards, args.runs)
    full_disks(outcomes["preprocess disk full"], work, "preprocess", pre_args, pre, args.runs,
               rng, rows_of)
    full_disks(outcomes["write disk full"], work, "write", write_args, shards, args.runs, rng,
               records_of)
    flaky_http(outcomes["preprocess over flaky HTTP"], outcomes["loader over flaky HTTP"], work,
               data.root, pre, shards, args.runs)
    train_kills(outcomes["train kill -9"], work, train_args,
                args.kills if args.train_kills is None else args.train_kills, rng)

    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, python "
          f"{platform.python_version()}\n")
    print("| fault | trials | faults injected | faulted run ended in a clear error | "
          "final output identical | lost |\n|---|---:|---|---:|---:|---:|")
    for o in outcomes.values():
        faults = ", ".join(f"{k} {v}" for k, v in sorted(o.faults.items())) or "-"
        errors = "-" if "kill" in o.kind or "HTTP" in o.kind or "torn" in o.kind else \
            o.clear_error
        print(f"| {o.kind} | {o.trials} | {faults} | {errors} | {o.identical} | {o.lost} |")
    for o in outcomes.values():
        for note in o.notes:
            print(f"- {o.kind}: {note}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump([asdict(o) for o in outcomes.values()], f, indent=1)


if __name__ == "__main__":
    main()
