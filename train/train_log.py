"""Writing ``train_log.jsonl`` (one JSON line per optimizer step, by global rank 0) and
``pipeline.json``: the records ``vlmshard.run_log`` describes and reads.

Torch-free, so that anything that writes a train log (the trainer, tests, tools) makes the
records with the same code.
"""

from __future__ import annotations

import json
import logging
import os
from typing import IO

from vlmshard.io import atomic_write
from vlmshard.model_sizes import (
    CostTerms,
    LayerWork,
    ModelConfig,
    forward_flops,
    vit_attention_size,
)
from vlmshard.run_log import LOG_NAME

log = logging.getLogger(__name__)


def micro_batch_size(batch: dict, model: ModelConfig) -> dict:
    """The sizes the cost model and the simulator read: tiles, tokens, Σseq_len², the supervised
    tokens (the LM head's rows: ``supervised_count``), for a model with sliding-window layers
    their Σ m·(2·seq_len − m), m = min(seq_len, window) (``model_sizes.CostTerms.windowed``),
    and for a ViT attending across whole images its spans' squares
    (``model_sizes.vit_attention_size``). A sequence-parallel share's are this rank's part: its
    own tiles, media and supervised tokens, its real tokens and 1/sp of the whole's attention."""
    import numpy as np

    shard = batch.get("shard")
    if shard is None:
        lens = np.diff(np.asarray(batch["cu_seqlens"][:batch["num_samples"] + 1],
                                  dtype=np.int64))
        tokens, share = int(batch["num_tokens"]), 1
    else:  # a sequence-parallel share: its real tokens, 1/sp of the whole's attention
        lens = np.asarray(shard.sample_lengths, dtype=np.int64)
        tokens = max(0, min(shard.start + shard.length, int(lens.sum())) - shard.start)
        share = shard.sp
    sizes = {"tiles": int(batch["num_tiles"]), "tokens": tokens,
             "squares": int(round((lens ** 2).sum() / share)),
             # a batch made from length rows holds no labels: its tokens, the most there can be
             "supervised": supervised_count(batch) if "labels" in batch else tokens}
    window = model.llm.sliding_window
    if window:
        m = np.minimum(lens, window)
        sizes["windowed"] = int(round((m * (2 * lens - m)).sum() / share))
    if model.vision.fused_qkv:
        grids = batch["image_grid_thw"].tolist() if "image_grid_thw" in batch else []
        vit = vit_attention_size(model.vision, grids)
        sizes["vit_squares"] = int(vit.vit_squares)
        if model.vision.window:
            sizes["vit_windows"] = int(vit.vit_windows)
    return sizes


def supervised_count(batch: dict) -> int:
    """Tokens of a collated micro-batch with a next-token target, as the trainer's loss finds
    them (``shards.model_inputs.supervised_tokens``, here without torch): label t + 1 of the
    same sample; a sequence-parallel share's labels are its targets already."""
    import numpy as np

    from vlmshard.preprocess.tokenize import IGNORE_INDEX

    labelled = np.asarray(batch["labels"]) != IGNORE_INDEX
    if "shard" in batch:
        return int(labelled.sum())
    # target i is label i + 1, except at each sample's last token (the next sample's first)
    firsts = np.asarray(batch["cu_seqlens"], dtype=np.int64)[1:]
    firsts = firsts[(firsts > 0) & (firsts < len(labelled))]
    return int(labelled[1:].sum() - labelled[np.unique(firsts)].sum())


def rank_timing(*, rank: int, stage: int, dp_rank: int, forward_s: float, backward_s: float,
                pipeline_s: float, step_time_s: float, load_s: float = 0.0,
                parts: dict[str, float] | None = None, recompute_s: float = 0.0,
                optimizer_s: float = 0.0, host: dict[str, float] | None = None) -> dict:
    """One rank's timings of a step: ``pipeline_s`` from the step's start to the end of its
    last backward (the replica's pipeline is its stages' longest; the rest of the step is the
    gradient all-reduce and the optimizer); ``wait_s`` the step time less its own compute;
    ``load_s`` the time it waited for its loader before the step (outside the step time);
    ``time_breakdown`` (``time_breakdown``) where the rank's load and step went, by part;
    ``host_breakdown`` the host's time launching each part, recompute and the optimizer
    (``clock.StageTimes.host``): a part whose host time nears its own is host-bound."""
    return {"rank": rank, "stage": stage, "dp_rank": dp_rank, "forward_s": forward_s,
            "backward_s": backward_s, "pipeline_s": pipeline_s,
            "wait_s": max(0.0, step_time_s - forward_s - backward_s),
            "step_time_s": step_time_s, "load_s": load_s,
            "time_breakdown": time_breakdown(
                parts=parts or {}, recompute_s=recompute_s, optimizer_s=optimizer_s,
                forward_s=forward_s, backward_s=backward_s, pipeline_s=pipeline_s,
                step_time_s=step_time_s, load_s=load_s),
            "host_breakdown": dict(host or {})}


def time_breakdown(*, parts: dict[str, float], recompute_s: float, optimizer_s: float,
                   forward_s: float, backward_s: float, pipeline_s: float, step_time_s: float,
                   load_s: float) -> dict[str, float]:
    """A rank's loading and step (``load_s + step_time_s``) in seconds by part: each part of the
    model's forward and backward without recompute (``parts``: vit, projector, llm, head), the
    re-forward of recomputed layers in backward, the optimizer's step, the waiting inside the
    pipeline (its time less its own forward and backward: bubbles, sends and receives, and the
    host between micro-batches), the wait for data (``load_s``), and ``other``: the rest
    (gradient all-reduce and clipping, the weights' update after the optimizer, the loss's
    broadcast, host overhead). The parts are measured apart, so nothing but ``other`` is a
    remainder; it is never negative, so measured parts that overlapped would sum to more than
    the step."""
    out = {**parts, "recompute": recompute_s, "optimizer": optimizer_s,
           "pipeline_wait": max(0.0, pipeline_s - forward_s - backward_s), "data_wait": load_s}
    out["other"] = max(0.0, load_s + step_time_s - sum(out.values()))
    return out


def rank_data(micro: list[dict], model: ModelConfig) -> dict:
    """What a data-parallel rank's first stage trained in a step, from its loader batches, in
    the sizes of ``model`` (``micro_batch_size``)."""
    sizes = [micro_batch_size(b, model) for b in micro]
    return {"tokens": sum(s["tokens"] for s in sizes),
            "plan_steps": [b["step"] for b in micro],
            "micro_sizes": sizes,
            "sample_ids": [b["sample_ids"].tolist() for b in micro]}


def recompute_flops(names: list[str], work: list[LayerWork], modes: list[str],
                    recompute: list[str]) -> CostTerms:
    """Per unit of ``CostTerms``, the FLOPs a step runs again in backward beyond the model's
    (``model_sizes.training_flops``): the forward of each trainer layer (``names``, their
    analytic ``work``: ``model_sizes.trainer_layer_work``, run as ``modes`` say) named in
    ``recompute`` (recomputed whole), as it runs (``model_sizes.forward_flops``: the LM head's
    fused loss computes its gradients in its forward, so the logits' matmul never runs twice
    unless the head itself is recomputed). Selective recompute runs no matrix multiplies again
    and adds none."""
    again = [forward_flops(w, mode) for n, w, mode in zip(names, work, modes) if n in recompute]
    return sum(again, CostTerms())


def step_record(step: int, loss: float, lr: float, ranks: list[dict],
                flops: CostTerms, again: CostTerms = CostTerms()) -> dict:
    """One line of train_log.jsonl from every rank's timings (``rank_timing``, with ``data``
    from ``rank_data`` on first-stage ranks).

    ``model_flops`` is the step's useful training work (forward + backward of the real tiles,
    tokens and per-sample attention, and the ViT's attention per image, padding excluded) from
    the model's analytic FLOPs: divided by step time and the cluster's peak it is the MFU;
    ``hardware_flops`` adds the FLOPs run again in backward (``again``, per unit of ``CostTerms``:
    ``recompute_flops``), for the HFU. ``end_to_end_tokens_per_s`` also counts the slowest
    rank's loading, which precedes the step. ``lr``: the learning rate the step's
    update used."""
    seconds = max(r["step_time_s"] for r in ranks)
    load = max(r.get("load_s", 0.0) for r in ranks)
    data = sorted((r for r in ranks if "data" in r), key=lambda r: r["dp_rank"])
    tokens = sum(r["data"]["tokens"] for r in data)
    sizes = [CostTerms(**m) for r in data for m in r["data"]["micro_sizes"]]
    model_flops = sum(flops.dot(m) for m in sizes)
    hardware_flops = model_flops + sum(again.dot(m) for m in sizes)
    return {"step": step, "loss": loss, "lr": lr, "step_time_s": seconds, "load_s": load,
            "tokens": tokens,
            "tokens_per_s": tokens / seconds if seconds else 0.0,
            "end_to_end_tokens_per_s": tokens / (seconds + load) if seconds + load else 0.0,
            "model_flops": model_flops,
            "model_flops_per_s": model_flops / seconds if seconds else 0.0,
            "hardware_flops": hardware_flops,
            "hardware_flops_per_s": hardware_flops / seconds if seconds else 0.0,
            "ranks": [{k: v for k, v in r.items() if k != "data"} for r in ranks],
            "data": [{"dp_rank": r["dp_rank"], **r["data"]} for r in data]}


def pipeline_record(model: dict, stages: list[tuple[int, list[str], list[str], list[str]]],
                    partition_source: str = "", memory: list[dict] | None = None,
                    budget_bytes: int = 0, attention: str = "", kernels: dict | None = None,
                    saves: dict | None = None, modes: dict[str, str] | None = None) -> dict:
    """``pipeline.json``: the model's analytic sizes (``ModelConfig.to_dict``) and, per stage,
    the layers it held and those it recomputed whole and selectively, from every rank's
    ``(stage, layers, recompute, selective)`` (the replicas of a stage hold the same;
    ``vlmshard.train.recompute``), its predicted peak by part at the
    caps (``memory``, per stage) beside the budget the memory model leaves a stage, and where
    the partition came from (``vlmshard.train.default_partition.ChosenPartition``), the
    attention backend (``vlmshard.train.attention``) and optional kernels the layers took
    (``vlmshard.train.kernels.Kernels``) and what the memory
    model counted them to keep for backward (``vlmshard.model_sizes.Saves``), and how the
    run's recipe ran each layer (``modes``: ``vlmshard.recipe``; every layer trains without
    it)."""
    by_stage = {stage: rest for stage, *rest in stages}
    memory = memory or [{} for _ in by_stage]
    return {"model": model, "partition_source": partition_source,
            "memory_budget_bytes": budget_bytes, "attention": attention,
            "kernels": kernels or {},
            "saves": saves or {},
            "stages": [{"stage": s, "layers": by_stage[s][0], "recompute": by_stage[s][1],
                        "selective": by_stage[s][2],
                        "modes": [(modes or {}).get(n, "train") for n in by_stage[s][0]],
                        **({"memory": memory[s]} if memory[s] else {})}
                       for s in sorted(by_stage)]}


def open_log(out: str, first_step: int = 0) -> IO[str]:
    """``OUT/train_log.jsonl`` for a run starting at ``first_step``: a fresh file at step 0;
    when resuming, the steps logged before ``first_step`` are kept and the rest dropped (they
    ran after the checkpoint resumed from, and run again now), then new steps are appended."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, LOG_NAME)
    if first_step > 0 and os.path.exists(path):
        kept, dropped = [], 0
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    step = json.loads(line)["step"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    break  # a line the crash tore ends what was logged
                if step < first_step:
                    kept.append(line if line.endswith("\n") else line + "\n")
                else:
                    dropped += 1
        if dropped:
            log.info("%s: dropping %d step(s) logged after the checkpoint at step %d", path,
                     dropped, first_step)

        def write(tmp: str) -> None:
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(kept)

        atomic_write(path, write)
    return open(path, "a" if first_step > 0 else "w", encoding="utf-8")


def write_record(f: IO[str], record: dict) -> None:
    """One record as one line, flushed (a crashed run keeps every finished step)."""
    f.write(json.dumps(record) + "\n")
    f.flush()
