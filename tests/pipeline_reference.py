"""An independent replay of a logged training run from its profile: what ``vlmshard simulate
--train-log`` should predict, written from the model's description, not from vlmshard.simulate.

- A profiled layer's mean forward and backward seconds scale per micro-batch: ViT-side layers
  (up to and including ``projector``) with the micro-batch's tiles over the profiled mean
  tiles, the others (LLM blocks, head) with ``a_t·tokens + b·squares`` over its profiled mean.
- A stage's forward is the sum of its layers' forwards; its backward the sum of their backwards
  plus the forwards of its recomputed layers again. One machine: no link time.
- 1F1B per stage s of P with M micro-batches: min(P − s − 1, M) warm-up forwards, then one
  forward and one backward in turn, then the remaining backwards. An operation starts when its
  stage is free and its input is there: forward m on stage s after forward m on stage s − 1,
  backward m on stage s after backward m on stage s + 1 (the last stage: after its forward m).
- A step lasts as long as its slowest data-parallel replica's pipeline.
"""

from __future__ import annotations

from functools import lru_cache


def stage_order(stage: int, stages: int, micro: int) -> list[tuple[str, int]]:
    """The operations stage ``stage`` runs, in order, under 1F1B."""
    warmup = min(stages - stage - 1, micro)
    order = [("F", m) for m in range(warmup)]
    for m in range(micro - warmup):
        order += [("F", warmup + m), ("B", m)]
    return order + [("B", m) for m in range(micro - warmup, micro)]


def makespan(forward: list[list[float]], backward: list[list[float]]) -> float:
    """Seconds from the first forward to the last backward; forward[m][s], backward[m][s]."""
    micro, stages = len(forward), len(forward[0])
    orders = [stage_order(s, stages, micro) for s in range(stages)]
    position = {(s, op): i for s in range(stages) for i, op in enumerate(orders[s])}

    @lru_cache(maxsize=None)
    def end(s: int, kind: str, m: int) -> float:
        i = position[(s, (kind, m))]
        free = end(s, *orders[s][i - 1]) if i else 0.0
        if kind == "F":
            ready = end(s - 1, "F", m) if s else 0.0
            return max(free, ready) + forward[m][s]
        ready = end(s + 1, "B", m) if s < stages - 1 else end(s, "F", m)
        return max(free, ready) + backward[m][s]

    return max(end(s, "B", micro - 1) for s in range(stages))


def replay(records: list[dict], profile: dict, cost_model: dict, config: dict) -> list[float]:
    """Predicted seconds of each logged step (``records``: train_log lines) for a run whose
    ``train_config.json`` is ``config`` (its ``bounds`` and ``recompute``)."""
    layers = profile["layers"]
    names = [lay["name"] for lay in layers]
    projector = names.index("projector")
    a_t, b = cost_model["a_t"], cost_model["b"]
    profiled = profile["micro_batches"]
    mean_tiles = sum(p["tiles"] for p in profiled) / len(profiled)
    mean_llm = sum(a_t * p["tokens"] + b * p["squares"] for p in profiled) / len(profiled)
    bounds = config["bounds"]
    recompute = {names.index(n) for n in config.get("recompute") or []}

    def scale(i: int, size: dict) -> float:
        if i <= projector:
            return size["tiles"] / mean_tiles
        return (a_t * size["tokens"] + b * size["squares"]) / mean_llm

    def stage_times(size: dict) -> tuple[list[float], list[float]]:
        fwd, bwd = [], []
        for first, last in zip(bounds, bounds[1:]):
            f = sum(layers[i]["forward_s"] * scale(i, size) for i in range(first, last))
            again = sum(layers[i]["forward_s"] * scale(i, size) for i in range(first, last)
                        if i in recompute)
            fwd.append(f)
            bwd.append(sum(layers[i]["backward_s"] * scale(i, size) for i in range(first, last))
                       + again)
        return fwd, bwd

    steps = []
    for record in records:
        replicas = []
        for data in record["data"]:
            times = [stage_times(size) for size in data["micro_sizes"]]
            replicas.append(makespan([f for f, _ in times], [b_ for _, b_ in times]))
        steps.append(max(replicas))
    return steps
