"""The cluster simulator: the 1F1B recurrence against its closed form, replicas and waiting by
hand, ``vlmshard simulate`` on a vendored slice of OmniBal's InternVL-1.2M lengths, and a
recorded CPU training run replayed."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from helpers import vlmshard, vlmshard_here
from vlmshard.errors import ConfigError
from vlmshard.simulate.model import (LayerRates, StageModel, one_f_one_b, pipeline_times,
                                    planned_columns, replica_micro_batches, simulate)
from vlmshard.partition import Partition, Stage
from vlmshard.simulate.replay import validate_against_log

from pipeline_reference import makespan as reference_makespan
from pipeline_reference import replay

OMNIBAL_META = os.path.join(os.path.dirname(__file__), "data", "omnibal", "meta.json")


def test_stages_compute_the_real_sizes_and_send_the_caps():
    """Two layers, one per stage: layer 0 costs 1 s per tile forward and sends 10 bytes per
    tile; layer 1 costs 1 s per token; backward is twice the forward; the link moves 10 bytes/s.
    A micro-batch of 2 tiles and 3 tokens under caps of 4 tiles and 6 tokens: stage 0 computes
    2 s and sends its 4-tile output (4 s) forward; stage 1 computes 3 s forward, 6 s backward and
    sends the 4-tile gradient back (4 s); stage 0's backward is 4 s."""
    rates = LayerRates(forward=np.array([[1.0, 0, 0], [0, 1.0, 0]]),
                       backward=np.array([[2.0, 0, 0], [0, 2.0, 0]]),
                       output_bytes=np.array([[10.0, 0, 0], [0, 5.0, 0]]))
    partition = Partition([0, 1, 2], [Stage(0, 1, []), Stage(1, 2, [])])
    model = StageModel.build(rates, partition, link_bytes_per_s=10.0)
    forward, backward = model.times(np.array([[2.0, 3.0, 0.0]]), np.array([4.0, 6.0, 0.0]))
    np.testing.assert_allclose(forward, [[2 + 4, 3]])
    np.testing.assert_allclose(backward, [[4, 6 + 4]])
    # Without caps the sends follow the sizes (a log replay on one machine sends nothing).
    forward, backward = model.times(np.array([[2.0, 3.0, 0.0]]))
    np.testing.assert_allclose(forward, [[2 + 2, 3]])
    np.testing.assert_allclose(backward, [[4, 6 + 2]])


@pytest.mark.parametrize("stages,micro", [(1, 1), (1, 5), (2, 1), (3, 4), (4, 8), (8, 3)])
def test_uniform_1f1b_has_the_textbook_makespan(stages, micro):
    """Equal stages: (M + P − 1)(f + b), so the bubble is (P − 1) / (M + P − 1)."""
    f, b = 1.0, 2.0
    forward = np.full((1, micro, stages), f)
    makespan, busy = pipeline_times(forward, np.full((1, micro, stages), b))
    assert makespan[0] == pytest.approx((micro + stages - 1) * (f + b))
    bubble = 1 - busy.sum() / (stages * makespan[0])
    assert bubble == pytest.approx((stages - 1) / (micro + stages - 1))


@pytest.mark.parametrize("stages,micro", [(2, 1), (2, 5), (3, 4), (4, 8), (5, 3), (3, 2)])
def test_1f1b_recurrence_equals_the_per_stage_schedule(stages, micro):
    """Unequal random stage times: the recurrence gives the makespan of each stage running its
    own 1F1B order (warm-up forwards, one forward one backward, cool-down backwards)."""
    rng = np.random.default_rng(stages * 100 + micro)
    f, b = rng.uniform(0.1, 3.0, (micro, stages)), rng.uniform(0.1, 6.0, (micro, stages))
    got = pipeline_times(f[None], b[None])[0][0]
    assert got == pytest.approx(reference_makespan(f.tolist(), b.tolist()), rel=1e-12)


def test_1f1b_order_runs_each_operation_once_after_what_it_needs():
    order = one_f_one_b(4, 6)
    assert sorted(order) == sorted((k, s, m) for k in "FB" for s in range(4) for m in range(6))
    seen = set()
    for kind, s, m in order:
        need = ("F", s - 1, m) if kind == "F" and s else ("B", s + 1, m) if kind == "B" and s < 3 \
            else ("F", s, m) if kind == "B" else None
        assert need is None or need in seen
        seen.add((kind, s, m))
    # 1F1B: stage 0 never holds more than P micro-batches whose backward is pending.
    in_flight = peak = 0
    for kind, s, _ in order:
        if s == 0:
            in_flight += 1 if kind == "F" else -1
            peak = max(peak, in_flight)
    assert peak == 4


def test_a_slow_stage_sets_the_pace():
    """Steady state runs at the slowest stage: makespan grows by its f + b per micro-batch."""
    forward = np.array([[[1.0, 3.0]] * 10])
    backward = 2 * forward
    ten = pipeline_times(forward, backward)[0][0]
    eleven = pipeline_times(np.concatenate([forward, forward[:, :1]], axis=1),
                            np.concatenate([backward, backward[:, :1]], axis=1))[0][0]
    assert eleven - ten == pytest.approx(3.0 + 6.0)


def test_replicas_take_their_virtual_ranks_and_wait_for_the_slowest():
    # 2 steps x 4 virtual ranks x 1 micro-batch; sizes are (tiles, tokens, squares).
    sizes = np.arange(8 * 3, dtype=float).reshape(8, 3)
    batches = replica_micro_batches(sizes, ranks=4, micro=1, dp=2)
    assert batches.shape == (2, 2, 2, 3)  # steps, replicas, micro-batches, sizes
    np.testing.assert_array_equal(batches[1, 1], sizes[[6, 7]])  # step 1, ranks 2 and 3
    regrouped = replica_micro_batches(sizes, ranks=4, micro=1, dp=2, per_step=4)
    np.testing.assert_array_equal(regrouped[0, 0], sizes[[0, 1, 4, 5]])
    with pytest.raises(ConfigError, match="does not divide"):
        replica_micro_batches(sizes, ranks=4, micro=1, dp=3)

    # One stage costing 1 s per token forward, 2 s backward: replica loads are token sums.
    model = StageModel(forward=planned_columns(np.array([[0.0, 1.0, 0.0]])),
                       backward=planned_columns(np.array([[0.0, 2.0, 0.0]])))
    loads = np.zeros((2, 2, 1, 3))
    loads[:, :, 0, 1] = [[1, 3], [2, 2]]
    sim = simulate(loads, model)
    np.testing.assert_allclose(sim.step_seconds, [9.0, 6.0])
    assert sim.seconds == 15.0
    assert sim.waiting_fraction == pytest.approx(1 - (3 + 9 + 6 + 6) / (2 * 15))
    assert sim.bubble_fraction == 0.0
    assert sim.gpu_days == pytest.approx(15 * 2 / 86400)


def test_simulate_compares_strategies_and_levers(tmp_path):
    plan = tmp_path / "plan"
    vlmshard_here("pack", "--stats", OMNIBAL_META, "--dp", "4", "--micro-batches", "2",
                  "--out", str(plan))
    out = tmp_path / "sim.json"
    text = vlmshard("simulate", str(plan), "--model", "internvl2-2b", "--gpu", "h100",
                    "--pp", "2", "--micro-batches", "8", "--out-json", str(out)).stdout
    result = json.loads(out.read_text())
    assert result["plan"]["gpus"] == 8 and "GPU-days" in text
    assert result["plan"]["compute_mode"] == "padding-free" and "padding-free compute" in text
    strategies = result["strategies"]
    assert set(strategies) == {"random", "lengthgroup", "isf", "balanced", "orchmllm",
                               "veomni-vit", "loongforge"}
    assert "exchange" in text and "planning" in text
    for name in ("orchmllm", "veomni-vit", "loongforge"):  # what they start from: random's
        assert (strategies[name]["qv"], strategies[name]["qt"]) == \
            (strategies["random"]["qv"], strategies["random"]["qt"])
        assert 0 < strategies[name]["exchange_share"] < 1
        assert 0 < strategies[name]["planning_share"] < 1
        assert 0 < strategies[name]["moved_share"] <= 1
    # re-dealing both sides each step waits less than the micro-batches as loaded
    assert strategies["orchmllm"]["waiting_fraction"] < strategies["random"]["waiting_fraction"]
    assert strategies["balanced"]["waiting_fraction"] < strategies["random"]["waiting_fraction"]
    assert strategies["balanced"]["seconds"] < strategies["random"]["seconds"]
    levers = [result["levers"][k]["seconds"] for k in
              ("baseline", "+ data balance", "+ model balance", "+ memory balance")]
    assert all(a >= b for a, b in zip(levers, levers[1:])), levers
    for r in (*strategies.values(), *result["levers"].values()):
        assert 0 <= r["bubble_fraction"] < 1 and 0 <= r["waiting_fraction"] < 1


H100_BF16_PEAK = 989e12


@pytest.fixture(scope="module")
def padded_plan(tmp_path_factory):
    """The vendored slice packed ``balanced`` for a padded trainer: 2 ranks x 2 micro-batches."""
    from vlmshard.packing.config import PackConfig
    from vlmshard.packing.plan import run_pack

    plan = tmp_path_factory.mktemp("padded") / "plan"
    run_pack(PackConfig(stats=OMNIBAL_META, dp=2, micro_batches=2, out=str(plan),
                        model="internvl2-2b", compute_mode="padded"))
    return plan


def _simulate(plan, **options) -> dict:
    from vlmshard.simulate.config import SimulateConfig
    from vlmshard.simulate.runs import run_simulate

    return run_simulate(SimulateConfig(**{"plan": str(plan), "model": "internvl2-2b",
                                          "gpu": "h100", "pp": 1, "mfu": 0.5, "compare": False,
                                          **options}))


def hand_counted_seconds(plan, padded: bool) -> float:
    """The epoch counted from plan.parquet, the length rows and plan.json's cost model and caps.
    One stage: a replica's step is its micro-batches' forward and backward back to back, i.e.
    its training FLOPs (a_v·tiles + a_t·tokens + b·Σlen² + a_s·supervised) at the sustained
    rate; a step waits for the slowest rank. Padded: every micro-batch computes Qv tiles and Qt
    tokens, attention and the LM head only over its real samples; padding-free: the real tiles
    and tokens. OmniBal's length rows hold no labels: every token counts as supervised, the
    most there can be."""
    import pyarrow.parquet as pq

    info = json.loads((plan / "plan.json").read_text())
    assert info["cost_model"]["origin"] == "flops:internvl2-2b"
    a_v, a_t, b, a_s = (info["cost_model"][k] for k in ("a_v", "a_t", "b", "a_s"))
    folder = os.path.dirname(OMNIBAL_META)
    rows = []  # sample_id order: meta.json's files in turn
    for name in ("ai2d_train_12k_head.json", "docvqa_train_10k_head.json"):
        with open(os.path.join(folder, name)) as f:
            rows += json.load(f)
    steps = info["metrics"]["steps"]
    flops = {(s, r): 0.0 for s in range(steps) for r in range(2)}
    if padded:
        per_micro = a_v * info["metrics"]["qv"] + a_t * info["metrics"]["qt"]
        flops = {key: 2 * per_micro for key in flops}  # 2 micro-batches per rank, empty or not
    for placed in pq.read_table(plan / "plan.parquet").to_pylist():
        row = rows[placed["sample_id"]]
        tiles, tokens = row["vit_num"], row["token_num"]
        flops[placed["step"], placed["rank"]] += b * tokens ** 2 + a_s * tokens + (
            0.0 if padded else a_v * tiles + a_t * tokens)
    return sum(max(flops[s, 0], flops[s, 1]) for s in range(steps)) / (0.5 * H100_BF16_PEAK)


def test_a_padded_step_is_charged_the_caps_and_padding_free_the_real_work(padded_plan):
    padded = _simulate(padded_plan, compute_mode="padded")["plan"]
    free = _simulate(padded_plan, compute_mode="padding-free")["plan"]
    for result in (padded, free):
        assert result["partition"]["recompute"] == [0]  # else backward would rerun forwards
        assert result["steps"] == json.loads((padded_plan / "plan.json").read_text())[
            "metrics"]["steps"]
    assert padded["seconds"] == pytest.approx(hand_counted_seconds(padded_plan, True), rel=1e-9)
    assert free["seconds"] == pytest.approx(hand_counted_seconds(padded_plan, False), rel=1e-9)
    # The caps are never below a micro-batch's real sizes, and this plan does not fill them.
    assert padded["seconds"] > free["seconds"]


def test_the_simulated_compute_mode_defaults_to_the_plans(padded_plan, tmp_path):
    from vlmshard.simulate.runs import format_result

    result = _simulate(padded_plan)
    assert result["plan"]["compute_mode"] == "padded"
    assert result["plan"]["seconds"] == pytest.approx(hand_counted_seconds(padded_plan, True),
                                                      rel=1e-9)
    assert "padded compute" in format_result(result)
    # A plan from before compute modes (no params.compute_mode) was made for padding-free.
    old = tmp_path / "old"
    old.mkdir()
    for name in ("plan.parquet", "plan.run.json"):
        (old / name).write_bytes((padded_plan / name).read_bytes())
    info = json.loads((padded_plan / "plan.json").read_text())
    del info["params"]["compute_mode"]
    (old / "plan.json").write_text(json.dumps(info))
    result = _simulate(old)
    assert result["plan"]["compute_mode"] == "padding-free"
    assert result["plan"]["seconds"] == pytest.approx(hand_counted_seconds(padded_plan, False),
                                                      rel=1e-9)


def test_simulate_errors_are_one_line(tmp_path):
    for args, message in [((str(tmp_path),), "no plan.json"),
                          ((str(tmp_path), "--gpu", "tpu"), "invalid choice: 'tpu'"),
                          (("--train-log", "x.jsonl"), "needs --profile"),
                          ((), "give a PLAN_DIR")]:
        proc = vlmshard("simulate", *args, check=False)
        err = proc.stderr.strip().splitlines()
        assert proc.returncode != 0 and message in err[-1] and err[-1].startswith(
            "vlmshard simulate: error:"), proc.stderr


def test_simulator_replays_a_recorded_cpu_run_within_a_quarter():
    """Real measured step times (tests/data/recorded-cpu-run/README.md) against the simulator
    fed the profile's measured layer times: the check behind its GPU-days. Measured times are
    read here from the recorded train_log; predicted ones recomputed by tests/pipeline_reference
    (profile-scaled layer times, 1F1B per stage, written apart from vlmshard.simulate)."""
    recorded = os.path.join(os.path.dirname(__file__), "data", "recorded-cpu-run")
    log = os.path.join(recorded, "run", "train_log.jsonl")
    check = validate_against_log(log, recorded)
    with open(log) as f:
        records = [json.loads(line) for line in f if line.strip()][1:]  # warm-up left out
    read = lambda name: json.load(open(os.path.join(recorded, name)))  # noqa: E731
    predicted = replay(records, read("profile.json"), read("cost_model.json"),
                       read("run/train_config.json"))
    measured = [r["step_time_s"] for r in records]
    assert check["steps"] == len(records) == 4  # 5 logged, the warm-up left out
    assert [s["step"] for s in check["per_step"]] == [r["step"] for r in records] == [1, 2, 3, 4]
    assert [s["measured_s"] for s in check["per_step"]] == measured
    assert check["measured_s"] == pytest.approx(sum(measured), rel=1e-12)
    assert [s["predicted_s"] for s in check["per_step"]] == pytest.approx(predicted, rel=1e-9)
    assert check["predicted_s"] == pytest.approx(sum(predicted), rel=1e-9)
    assert check["total_error"] == pytest.approx(sum(predicted) / sum(measured) - 1, rel=1e-9)
    errors = [abs(p - m) / m for p, m in zip(predicted, measured)]
    assert check["median_step_error"] == pytest.approx(float(np.median(errors)), rel=1e-9)
    assert abs(check["total_error"]) < 0.25 and check["median_step_error"] < 0.25, check


def test_the_replay_takes_the_profiles_sustained_rate_per_layer_kind():
    """Two ViT blocks (1e6 FLOPs per tile each and 100 per image's squared patches), an LLM
    block (1e4 per token, 10 per squared length) and the token embedding (no FLOPs), profiled
    on micro-batches of mean size (3 tiles, 200 tokens, 8000 squares, 1e4 squared patches). By
    hand: the ViT blocks did 3·2·(1e6·3 + 100·1e4) = 24e6 training FLOPs in 0.001 + 0.002 +
    0.002 + 0.004 = 0.009 s, 2.67e9 FLOP/s, 2/3 of a 4e9 peak; the LLM
    block 3·(1e4·200 + 10·8000) = 6.24e6 in 0.003 s, 2.08e9, 52% of it; the embedding has no
    rate and costs nothing. Replayed at those rates, the mean micro-batch takes what the
    profile measured: 0.012 s."""
    from vlmshard.errors import InputError
    from vlmshard.model_sizes import LayerWork, CostTerms
    from vlmshard.simulate.model import sustained_flops_per_s

    def layer(name, kind, forward_s, flops):
        return ({"name": name, "kind": kind, "forward_s": forward_s, "backward_s": 2 * forward_s},
                LayerWork(name, 0, flops, CostTerms(), CostTerms()))

    rows = [layer("vit_block_0", "vit_block", 0.001, CostTerms(tiles=1e6, vit_squares=100)),
            layer("vit_block_1", "vit_block", 0.002, CostTerms(tiles=1e6, vit_squares=100)),
            layer("embed_tokens", "embed_tokens", 0.0005, CostTerms()),
            layer("llm_block_0", "llm_block", 0.001, CostTerms(tokens=1e4, squares=10))]
    profile = {"layers": [r[0] for r in rows],
               "micro_batches": [{"tiles": 2, "tokens": 100, "squares": 4000,
                                  "vit_squares": 5000},
                                 {"tiles": 4, "tokens": 300, "squares": 12000,
                                  "vit_squares": 15000}]}
    work = [r[1] for r in rows]
    rates = sustained_flops_per_s(profile, work)
    assert set(rates) == {"vit_block", "llm_block"}
    assert {k: v / 4e9 for k, v in rates.items()} == pytest.approx(
        {"vit_block": 2 / 3, "llm_block": 0.52}, rel=1e-12)
    stage = StageModel.build(LayerRates.sustained(work, profile),
                             Partition([0, 4], [Stage(0, 4)]), float("inf"))
    forward, backward = stage.times(np.array([[3.0, 200.0, 8000.0, 1e4, 0.0, 0.0]]))
    assert float(forward[0, 0]) == pytest.approx(0.004, rel=1e-12)
    assert float(forward[0, 0] + backward[0, 0]) == pytest.approx(0.012, rel=1e-12)
    del profile["layers"][0]["kind"]
    with pytest.raises(InputError, match="names no layer kinds"):
        LayerRates.sustained(work, profile)


def test_measured_layer_times_scale_a_qwen_vits_attention_by_its_analytic_flops():
    """A profiled ViT block (1 s forward, 2 s backward at the profile's mean: 2 tiles and 100
    squared patch counts) whose analytic FLOPs are 10 per tile and 0.8 per squared count (20 +
    80 at the mean), the projector (0.5 s; tiles only), an LLM block (1 s at 10 tokens, a_t
    only). A micro-batch of 2 tiles and 200 squared counts takes (20 + 160) / 100 = 1.8 s in
    the ViT block, 0.5 s in the projector and 1 s in the LLM block at 10 tokens; without the
    layers' work (or with a profile that logged no squared counts) the ViT block scales by
    tiles alone: 1 s."""
    from vlmshard.model_sizes import LayerWork, CostTerms

    def layer(name, forward_s):
        return {"name": name, "forward_s": forward_s, "backward_s": 2 * forward_s,
                "output_bytes": 0}

    profile = {"layers": [layer("vit_block_0", 1.0), layer("projector", 0.5),
                          layer("llm_block_0", 1.0)],
               "micro_batches": [{"tiles": 1, "tokens": 5, "squares": 25, "vit_squares": 50},
                                 {"tiles": 3, "tokens": 15, "squares": 25,
                                  "vit_squares": 150}]}
    work = [LayerWork("vit_block_0", 0, CostTerms(tiles=10, vit_squares=0.8), CostTerms(),
                      CostTerms()),
            LayerWork("projector_merge", 0, CostTerms(tiles=3), CostTerms(), CostTerms()),
            LayerWork("llm_block_0", 0, CostTerms(tokens=7), CostTerms(), CostTerms())]
    cost = {"a_t": 1.0, "b": 0.0}
    micro = np.array([2.0, 10, 25, 200, 0, 0])
    rates = LayerRates.from_profile(profile, cost, work)
    np.testing.assert_allclose(rates.forward @ micro, [1.8, 0.5, 1.0])
    np.testing.assert_allclose(rates.backward @ micro, [3.6, 1.0, 2.0])
    for plain in (LayerRates.from_profile(profile, cost),
                  LayerRates.from_profile({**profile, "micro_batches": [
                      {k: v for k, v in m.items() if k != "vit_squares"}
                      for m in profile["micro_batches"]]}, cost, work)):
        np.testing.assert_allclose(plain.forward @ micro, [1.0, 0.5, 1.0])


def test_a_plan_packed_for_a_frozen_vit_is_simulated_as_it_trains(tmp_path):
    """A plan packed with ``--train projector llm``: one stage's epoch is the hand count of its
    own cost model (the ViT's forward alone in a_v), below the full fine-tune's; on two stages
    the search gives the first stage more layers than it does for the full fine-tune."""
    from vlmshard.packing.config import PackConfig
    from vlmshard.packing.plan import run_pack

    results = {}
    for name, parts in (("full", ["vit", "projector", "llm"]), ("frozen", ["projector", "llm"])):
        plan = tmp_path / name
        run_pack(PackConfig(stats=OMNIBAL_META, dp=2, micro_batches=2, out=str(plan),
                            model="internvl2-2b", train=parts))
        one = _simulate(plan)["plan"]
        assert one["seconds"] == pytest.approx(hand_counted_seconds(plan, False), rel=1e-9)
        results[name] = (one["seconds"], _simulate(plan, pp=2)["plan"]["partition"]["bounds"])
    assert results["frozen"][0] < results["full"][0]
    assert results["frozen"][1][1] > results["full"][1][1], results


def test_lpt_deals_the_costliest_first_onto_the_least_loaded():
    """By hand: 5 to bin 0, 4 to bin 1, 3 to bin 1 (4 < 5), 3 to bin 0 (5 < 7); with a cap of
    8.5 (sizes 8, 4, 2, 1), the last cannot join bin 0's 8 and goes to bin 1 (6 + 1)."""
    from vlmshard.simulate.runtime import lpt

    costs = np.array([5.0, 4.0, 3.0, 3.0])
    assert lpt(costs, 2, np.ones(4)).tolist() == [0, 1, 1, 0]
    sizes = np.array([8.0, 4.0, 2.0, 1.0])
    assert lpt(costs, 2, sizes, cap=8.5).tolist() == [0, 1, 1, 1]


def _three_samples():
    """Sample 0: one image of 8 tiles and 100 tokens (4 supervised); samples 1 and 2: text of 10
    and 20 tokens."""
    from vlmshard.packing.batches import Lengths

    return Lengths(np.array([8, 0, 0]), np.array([100, 10, 20]), np.zeros(3, np.int32), ("a",),
                   supervised=np.array([4, 2, 6]), unit_squares=np.array([64.0, 0.0, 0.0]))


def test_runtime_strategies_deal_out_each_slot_and_price_what_moves():
    """Two replicas, one slot: replica 0 loaded sample 0 (8 tiles, 100 tokens) and sample 1
    (10 tokens), replica 1 sample 2 (20 tokens). OrchMLLM keeps the image where it is (it
    alone has tiles) and moves sample 1's LLM part to replica 1 (100 | 20 + 10): its 10 token
    ids cross NVLink. VeOmni's ViT balance moves nothing and leaves the LLM as loaded."""
    from vlmshard.packing.cost import CostModel
    from vlmshard.simulate.runtime import STRATEGIES, Links, rebalance

    items, offsets = np.array([0, 1, 2]), np.array([0, 2, 3])
    lengths = _three_samples()
    cost = CostModel(a_v=1.0, a_t=1.0, b=0.01, origin="hand", a_vs=0.5)
    links = Links(pixel_bytes=1e3, feature_bytes=1e2, intra_bytes_per_s=1e6,
                  inter_bytes_per_s=1e5)
    slots = np.array([[[0], [1]]])  # one step, two replicas, one slot
    exact = np.ones((3, 2))
    orch = rebalance(slots, items, offsets, lengths, cost, STRATEGIES["orchmllm"], links, exact)
    # tiles, tokens, Σlen², supervised, the image's tiles² (one unit of 8 tiles)
    assert orch.batches[0, :, 0].tolist() == [[8, 100, 10000, 4, 64], [0, 30, 500, 8, 0]]
    assert orch.exchange_s.tolist() == [10 * 8 / 1e6]
    assert orch.moved_share == 1 / 4  # of 1 ViT part and 3 LLM parts
    veomni = rebalance(slots, items, offsets, lengths, cost, STRATEGIES["veomni-vit"], links,
                       exact)
    assert veomni.batches[0, :, 0].tolist() == [[8, 110, 10100, 6, 64], [0, 20, 400, 6, 0]]
    assert veomni.exchange_s.tolist() == [0.0] and veomni.moved_share == 0


def test_an_all_to_all_is_as_slow_as_its_busiest_rank_and_slower_across_nodes():
    """Rank 0 sends 1 MB to rank 1 (its node) and 1 MB to rank 8 (the next node): 1 ms on
    NVLink at 1 GB/s and 10 ms over the network at 100 MB/s, back to back on rank 0's side."""
    from vlmshard.simulate.runtime import Links

    links = Links(0, 0, intra_bytes_per_s=1e9, inter_bytes_per_s=1e8)
    seconds = links.all_to_all(np.array([0, 0, 3]), np.array([1, 8, 3]),
                               np.array([1e6, 1e6, 5e6]), 16)
    assert seconds == pytest.approx(1e-3 + 1e-2)


def test_an_exact_cost_model_times_every_packing_as_the_packer_sizes_it(padded_plan):
    """All zero (any seed): every factor is exactly 1, and the true micro-batch sizes of a
    padded and a packed packing are the packer's own ``micro_batch_sizes``, to the bit."""
    from vlmshard.packing.metrics import micro_batch_sizes
    from vlmshard.packing.plan import load_plan, repack
    from vlmshard.simulate.cost_error import CostError, true_factors, true_sizes

    info, packing, lengths = load_plan(str(padded_plan))
    ones = true_factors(CostError(seed=7), len(lengths))
    assert ones.shape == (len(lengths), 2) and (ones == 1.0).all()
    for algo, padded in (("random", True), ("balanced", False)):
        packed = repack(info, lengths, algo, "padding-free").packing
        assert np.array_equal(true_sizes(lengths, packed, padded, ones),
                              micro_batch_sizes(lengths, packed, padded))


def test_cost_noise_is_seeded_and_within_its_spread():
    from vlmshard.simulate.cost_error import CostError, true_factors

    noisy = true_factors(CostError(noise=0.3, llm=-0.1, seed=1), 10_000)
    assert np.array_equal(noisy, true_factors(CostError(noise=0.3, llm=-0.1, seed=1), 10_000))
    assert 0.7 <= noisy[:, 0].min() and noisy[:, 0].max() <= 1.3
    assert 0.9 * 0.7 <= noisy[:, 1].min() and noisy[:, 1].max() <= 0.9 * 1.3
    assert noisy.mean(axis=0) == pytest.approx([1.0, 0.9], abs=0.01)
    assert not np.array_equal(noisy, true_factors(CostError(noise=0.3, seed=2), 10_000))
    with pytest.raises(ConfigError, match="noise must be in"):
        CostError(noise=1.0)


def test_a_bias_on_one_side_moves_no_runtime_dispatch_and_is_timed_in_full():
    """The case of ``test_runtime_strategies_deal_out_each_slot_and_price_what_moves`` with the
    ViT 30% slower than modelled: LPT deals one side alone, so scaling that side's costs moves
    nothing (LoongForge's refit included); the true tiles are 8 × 1.3 on the image's rank."""
    from vlmshard.packing.cost import CostModel
    from vlmshard.simulate.runtime import STRATEGIES, Links, rebalance

    items, offsets = np.array([0, 1, 2]), np.array([0, 2, 3])
    cost = CostModel(a_v=1.0, a_t=1.0, b=0.01, origin="hand", a_vs=0.5)
    links = Links(1e3, 1e2, intra_bytes_per_s=1e6, inter_bytes_per_s=1e5)
    slots = np.array([[[0], [1]]])
    slow_vit = np.tile([1.3, 1.0], (3, 1))
    for name in ("orchmllm", "loongforge"):
        re = rebalance(slots, items, offsets, _three_samples(), cost, STRATEGIES[name], links,
                       slow_vit)
        assert re.batches[0, :, 0].tolist() == [[8, 100, 10000, 4, 64], [0, 30, 500, 8, 0]]
        assert re.true[0, :, 0] == pytest.approx(np.array([[10.4, 100, 10000, 4, 64 * 1.3],
                                                           [0, 30, 500, 8, 0]]))


def test_a_slow_vit_times_the_balanced_plan_by_hand(tmp_path):
    """Four samples on 2 ranks, one micro-batch each, one stage: a rank's step is its
    micro-batch's training FLOPs at the sustained rate, and with the ViT 30% slower than the
    model that packed the plan, 1.3·a_v·tiles + a_t·tokens + b·len² + a_s·tokens (every token
    supervised: a length file holds no labels); the step waits for the slower rank."""
    import pyarrow.parquet as pq

    from vlmshard.packing.config import PackConfig
    from vlmshard.packing.plan import run_pack
    from vlmshard.simulate.cost_error import CostError

    rows = [{"vit_num": 12, "token_num": 3200}, {"vit_num": 2, "token_num": 900},
            {"vit_num": 0, "token_num": 2600}, {"vit_num": 7, "token_num": 2100}]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    (tmp_path / "meta.json").write_text(json.dumps(
        {"rows": {"token_lengths": str(tmp_path / "rows.json")}}))
    plan = tmp_path / "plan"
    run_pack(PackConfig(stats=str(tmp_path / "meta.json"), dp=2, micro_batches=1, out=str(plan),
                        model="internvl2-2b"))
    info = json.loads((plan / "plan.json").read_text())
    a_v, a_t, b, a_s = (info["cost_model"][k] for k in ("a_v", "a_t", "b", "a_s"))
    flops: dict[tuple[int, int], float] = {}
    for placed in pq.read_table(plan / "plan.parquet").to_pylist():
        row = rows[placed["sample_id"]]
        key = placed["step"], placed["rank"]
        flops[key] = flops.get(key, 0.0) + 1.3 * a_v * row["vit_num"] + (
            a_t * row["token_num"] + b * row["token_num"] ** 2 + a_s * row["token_num"])
    assert len(flops) == 2  # one step, both ranks used: all four samples placed
    expected = max(flops.values()) / (0.5 * H100_BF16_PEAK)
    slow = _simulate(plan, cost_error=CostError(vit=0.3))["plan"]
    assert slow["partition"]["recompute"] == [0]
    assert slow["seconds"] == pytest.approx(expected, rel=1e-9)
    assert slow["seconds"] > _simulate(plan)["plan"]["seconds"]


def test_a_cost_error_is_refused_for_padded_compute(padded_plan):
    from vlmshard.simulate.cost_error import CostError

    with pytest.raises(ConfigError, match="padding-free compute only"):
        _simulate(padded_plan, cost_error=CostError(vit=0.3))


@pytest.mark.parametrize("name", ["qwen3-vl-8b", "internvl2-2b"])
def test_a_plans_micro_batch_takes_the_simulator_the_flops_the_packer_charges(name):
    """One micro-batch of a plan (``micro_batch_sizes``' columns: 900 tiles in two images of 400
    and 500 tiles, 3,000 tokens in two samples, 1,000 supervised) through every layer's rates
    at 1 FLOP/s: its forward and backward seconds are the packer's ``CostModel.cost`` of it,
    the Qwen ViT's attention across each image included (its tiles² in patches², 4 a tile)."""
    from vlmshard.families import presets
    from vlmshard.model_sizes import layer_work
    from vlmshard.packing.cost import CostModel
    from vlmshard.simulate.model import in_patches, plan_sizes

    model = presets()[name]
    sizes = np.array([900.0, 3000.0, 1000.0 ** 2 + 2000.0 ** 2, 1000.0, 400.0 ** 2 + 500.0 ** 2])
    rates = LayerRates.from_work(layer_work(model), 1.0)
    columns = plan_sizes(in_patches(sizes, model.patches_per_tile))
    seconds = float((rates.forward + rates.backward).sum(axis=0) @ columns)
    assert seconds == pytest.approx(CostModel.from_sizes(model).cost(*sizes), rel=1e-12)
