"""A training run replayed by the simulator next to what it measured: a hand-counted 1F1B
pipeline, measured bubble and waiting from hand-made rank times, the analytic layers mapped
onto every family's real pipeline layers, and a recorded run replayed with its profile over the
stages its pipeline.json names."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from vlmshard.errors import InputError
from vlmshard.families import presets
from vlmshard.model_sizes import (
    NO_LAYER_WORK,
    ModelConfig,
    layer_work,
    training_flops,
)
from vlmshard.run_log import PIPELINE_NAME
from vlmshard.simulate.model import COLUMNS, PipelineTimes, StageModel, planned_columns
from vlmshard.simulate.replay import (
    analytic_rates,
    compare,
    measured_times,
    replay_batches,
    replay_run,
)
from vlmshard.train.train_log import pipeline_record


def _micro(tiles: int, tokens: int) -> dict:
    return {"tiles": tiles, "tokens": tokens, "squares": 0}


def test_replay_of_two_stages_and_two_micro_batches_is_the_hand_count():
    """Stage 0 takes `tiles` seconds forward, stage 1 `tokens`; backward twice that.

    Replica 0, micro-batches (tiles 1, tokens 2) and (2, 1): stage 0 runs F0 [0,1] F1 [1,3],
    stage 1 F0 [1,3] B0 [3,7], stage 0 B0 [7,9], stage 1 F1 [7,8] B1 [8,10], stage 0 B1
    [10,14]: makespan 14, each stage busy 9. Replica 1, two (1, 1): the textbook
    (M + P − 1)(f + b) = 9, each stage busy 6. So each stage idles 1 − 15/23 = 8/23 of the
    pipelines' time, and replica 1 waits 5 of the 28 replica-seconds: 5/28."""
    stages = StageModel(forward=planned_columns(np.array([[1.0, 0, 0], [0, 1.0, 0]])),
                        backward=planned_columns(np.array([[2.0, 0, 0], [0, 2.0, 0]])))
    record = {"data": [{"micro_sizes": [_micro(1, 2), _micro(2, 1)]},
                       {"micro_sizes": [_micro(1, 1), _micro(1, 1)]}]}
    times = replay_batches([record], stages)
    assert times.makespan.tolist() == [[14.0, 9.0]]
    assert times.busy.tolist() == [[[9.0, 9.0], [6.0, 6.0]]]
    assert times.stage_bubble_per_step() == pytest.approx(np.array([[8 / 23, 8 / 23]]))
    assert times.stage_bubble() == pytest.approx([8 / 23, 8 / 23])
    assert times.waiting_per_step() == pytest.approx([5 / 28])
    assert times.waiting() == pytest.approx(5 / 28)


def test_replay_costs_the_logged_vit_attention_sizes():
    """One stage costing 1 s per squared patch count of whole images and 10 s per windows',
    forward (backward twice that), and nothing else: a micro-batch logging 2 and 1 of them
    (and tiles, tokens and squares that cost nothing here) runs 12 s forward and 24 s backward;
    one logging none, of an older log or a ViT attending within tiles, runs 0 s."""
    stages = StageModel(forward=np.array([[0.0, 0, 0, 1, 10, 0]]),
                        backward=np.array([[0.0, 0, 0, 2, 20, 0]]))
    qwen = {**_micro(5, 7), "squares": 49, "vit_squares": 2, "vit_windows": 1}
    record = {"data": [{"micro_sizes": [qwen]}, {"micro_sizes": [_micro(5, 7)]}]}
    times = replay_batches([record], stages)
    assert times.makespan.tolist() == [[36.0, 0.0]]


def _rank(stage: int, d: int, forward: float, backward: float, pipeline: float) -> dict:
    return {"rank": 2 * stage + d, "stage": stage, "dp_rank": d, "forward_s": forward,
            "backward_s": backward, "pipeline_s": pipeline, "step_time_s": 6.0}


def test_measured_bubble_and_waiting_from_the_ranks_times():
    """Replica 0: stage 0 busy 1 + 2 in a 5 s pipeline, stage 1 busy 2 ending at 4 s: the
    replica's pipeline is 5 s, bubbles 2/5 and 3/5. Replica 1: busy 2 of 3 s and 1 of 2.5 s:
    3 s. Waiting: 1 − 8 / (2 · 5) = 0.2. Over two such steps, the second twice as long, the
    shares stay the same."""
    ranks = [_rank(0, 0, 1, 2, 5), _rank(0, 1, 1, 1, 3), _rank(1, 0, 1, 1, 4),
             _rank(1, 1, 0.5, 0.5, 2.5)]
    double = [{**r, **{k: 2 * r[k] for k in ("forward_s", "backward_s", "pipeline_s")}}
              for r in ranks]
    times = measured_times([{"ranks": ranks, "data": [{}, {}]},
                            {"ranks": double, "data": [{}, {}]}])
    assert times.makespan.tolist() == [[5, 3], [10, 6]]
    assert times.busy[0].tolist() == [[3, 2], [2, 1]]
    assert times.stage_bubble_per_step()[0] == pytest.approx([1 - 5 / 8, 1 - 3 / 8])
    assert times.waiting_per_step() == pytest.approx([0.2, 0.2])
    assert times.stage_bubble() == pytest.approx([1 - 15 / 24, 1 - 9 / 24])
    assert times.waiting() == pytest.approx(0.2)
    old = [{k: v for k, v in r.items() if k != "pipeline_s"} for r in ranks]
    assert measured_times([{"ranks": old, "data": [{}, {}]}]) is None


def test_an_idle_step_has_no_bubble():
    times = PipelineTimes(np.zeros((1, 2)), np.zeros((1, 2, 3)))
    assert times.stage_bubble().tolist() == [0, 0, 0] and times.waiting() == 0


@pytest.mark.parametrize("family", ["internvl", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_analytic_layers_map_onto_the_trainers_layers(family, tmp_path):
    """The trainer's real pipeline layers of each family (train/models) take the analytic
    model's layers once each: the projector is projector_merge, the token embedding and final
    norm do no counted work, so the rows sum to the whole model's forward FLOPs; layers up to
    the projector scale with tiles (a Qwen ViT block also with its spans' squares: 4 × its
    hidden size per squared patch count, Qwen2.5-VL's windowed blocks per their windows', its
    ``fullatt_block_indexes`` per the images'), the others with tokens and squares only."""
    from vlmshard.families import model_sizes
    from vlmshard.demo.data import demo_model
    from vlmshard.train.hf_model import model_layers

    folder = demo_model(family, str(tmp_path / "model"))
    names = model_layers(folder).names
    with open(f"{folder}/config.json") as f:
        config = json.load(f)
    model = model_sizes(config, "tiny")
    rates = analytic_rates(names, model)
    assert len(rates.forward) == len(names)
    # forward + backward, 3x the forward; the patch embedding's backward its weights' alone;
    # the LM head's fused loss computes its gradients in its forward: all three there, per
    # supervised token (no other layer's column), none in its backward
    embed, head = names.index("vit_embed"), names.index("head")
    total = training_flops(model) + layer_work(model)[0].flops
    forward = np.array([getattr(total.windows_as_full(), k) for k in COLUMNS]) / 3
    forward[COLUMNS.index("supervised")] *= 3
    assert rates.forward.sum(axis=0) == pytest.approx(forward, rel=1e-12)
    twice = 2 * rates.forward
    twice[embed] /= 2
    twice[head] = 0
    assert rates.backward == pytest.approx(twice)
    work = {w.name: w.flops for w in layer_work(model)}
    projector = names.index("projector")
    assert rates.forward[projector].tolist() == [work["projector_merge"].tiles, 0, 0, 0, 0, 0]
    for name in NO_LAYER_WORK:
        assert rates.forward[names.index(name)].tolist() == [0, 0, 0, 0, 0, 0]
    vit, llm = rates.forward[:projector + 1], rates.forward[projector + 1:]
    assert (vit[:, [1, 2, 5]] == 0).all() and (llm[:, [0, 3, 4]] == 0).all()
    # the LM head alone makes logits, per supervised token
    assert (llm[:-1, 5] == 0).all() and llm[-1, 5] > 0
    vision = config["vision_config"]
    full = vision.get("fullatt_block_indexes")  # Qwen2.5-VL's; the other Qwens': every block
    for i, name in enumerate(names[:projector]):
        if not name.startswith("vit_block_"):
            assert rates.forward[i, 3:5].tolist() == [0, 0]
        elif family.startswith("qwen"):
            per_square = 4 * vision.get("embed_dim", vision["hidden_size"])
            windowed = full is not None and int(name.rsplit("_", 1)[1]) not in full
            assert rates.forward[i, 3:5].tolist() == ([0, per_square] if windowed
                                                     else [per_square, 0]), name
    with pytest.raises(InputError, match="'mystery' has no counterpart"):
        analytic_rates(names + ["mystery"], model)
    with pytest.raises(InputError, match="do not cover"):
        analytic_rates([n for n in names if n != "head"], model)


def test_pipeline_json_keeps_the_model_sizes_and_each_stages_layers():
    model = presets()["internvl2-2b"]
    record = pipeline_record(model.to_dict(), [
        (1, ["llm_block_0", "head"], ["head"], ["llm_block_0"]),
        (0, ["vit_embed", "projector"], [], []),
        (1, ["llm_block_0", "head"], ["head"], ["llm_block_0"])],
        modes={"vit_embed": "forward", "projector": "train", "llm_block_0": "train",
               "head": "train"})
    assert ModelConfig.from_dict(json.loads(json.dumps(record["model"]))) == model
    assert record["stages"] == [
        {"stage": 0, "layers": ["vit_embed", "projector"], "recompute": [], "selective": [],
         "modes": ["forward", "train"]},
        {"stage": 1, "layers": ["llm_block_0", "head"], "recompute": ["head"],
         "selective": ["llm_block_0"], "modes": ["train", "train"]}]


def test_a_run_with_its_pipeline_json_replays_with_a_profile(tmp_path):
    """The recorded CPU run (tests/data/recorded-cpu-run) with the pipeline.json a trainer now
    writes: replayed with the profile's measured layer times, in seconds, over the stages
    pipeline.json names, its step times those of tests/pipeline_reference; a profile of other
    layers is refused."""
    from pipeline_reference import replay as reference_replay

    recorded = os.path.join(os.path.dirname(__file__), "data", "recorded-cpu-run")
    with open(os.path.join(recorded, "run", "train_log.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    for record in records:  # a stand-in for what a run now logs
        for rank in record["ranks"]:
            rank["pipeline_s"] = rank["forward_s"] + rank["backward_s"]
    run = tmp_path / "run"
    run.mkdir()
    (run / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    read = lambda name: json.load(open(os.path.join(recorded, name)))  # noqa: E731
    profile = read("profile.json")
    names = [lay["name"] for lay in profile["layers"]]
    stages = [(0, names[:5], [], []), (1, names[5:], ["head"], [])]
    (run / PIPELINE_NAME).write_text(json.dumps(pipeline_record(presets()["tiny"].to_dict(),
                                                                stages)))
    replay = replay_run(str(run / "train_log.jsonl"), recorded)
    assert replay.in_seconds and replay.stage_layers == [names[:5], names[5:]]
    want = reference_replay(records[1:], profile, read("cost_model.json"),
                            {"bounds": [0, 5, len(names)], "recompute": ["head"]})
    assert replay.predicted.makespan.max(axis=1) == pytest.approx(want, rel=1e-9)
    assert compare(replay)["step_seconds"]["per_step"][0]["predicted_s"] == \
        pytest.approx(want[0], rel=1e-9)
    stages = [(0, names[:5], [], []), (1, names[5:-1] + ["lm_head"], [], [])]
    (run / PIPELINE_NAME).write_text(json.dumps(pipeline_record(presets()["tiny"].to_dict(),
                                                                stages)))
    with pytest.raises(InputError, match="profiles other layers"):
        replay_run(str(run / "train_log.jsonl"), recorded)
