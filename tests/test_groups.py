"""Packing groups (Hierarchical Balance Packing): each sample in the smallest group that holds it,
every group's micro-batches within its caps over its data-parallel ranks, the steps in the order
asked, sequence parallelism's exchange priced as the cost model says, bad groups refused in one
line. Expected values are hand counts or loops written here, not the code under test."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pyarrow.parquet as pq
import pytest
from helpers import vlmshard
from length_mixes import mostly_text, write_length_file

from vlmshard.errors import ConfigError
from vlmshard.families import presets
from vlmshard.packing.algorithms import Caps
from vlmshard.packing.batches import Lengths, MediaUnits, Packing
from vlmshard.packing.config import PackConfig
from vlmshard.packing.cost import CostModel
from vlmshard.model_sizes import LLMConfig, sequence_parallel_refusal
from vlmshard.packing.groups import (Group, GroupedPacking, assign, given_groups, ladder,
                                     rank_balance,
                                     order_steps, pack_groups, parse_groups, search_groups)
from vlmshard.shards.sequence import media_pieces
from vlmshard.packing.plan import read_grouped_plan, run_pack
from vlmshard.packing.stats import load_stats

COST = CostModel.from_sizes(presets()["internvl2-2b"])


def long_tail(n: int, seed: int = 0) -> Lengths:
    """Lengths from 64 to 4096 tokens, log-normal, one tile per 256 tokens: a long tail that
    one rank's budget of 512 tokens cannot hold."""
    rng = np.random.default_rng(seed)
    tokens = np.clip(np.round(rng.lognormal(np.log(200), 1.0, n)), 64, 4096).astype(np.int64)
    return Lengths(np.maximum(tokens // 256, 1), tokens, (np.arange(n) % 2).astype(np.int32),
                   ("a", "b"))


def test_groups_parse_and_bad_specs_are_refused_in_one_line():
    assert parse_groups("auto") is None
    assert parse_groups("8192, 32768:4,131072:8") == [(8192, None), (32768, 4), (131072, 8)]
    for bad, says in [("8192,4096", "shortest first"), ("8192,8192", "shortest first"),
                      ("8k", "'8k' is not LENGTH"), ("0", "positive"), ("100:0", "positive")]:
        with pytest.raises(ConfigError, match=says) as e:
            parse_groups(bad)
        assert "\n" not in str(e.value)


def test_each_group_takes_the_fewest_ranks_that_hold_it():
    rank = Caps(4, 1000)
    # dp 12: SP degrees 1, 2, 3, 4, 6, 12
    got = given_groups([(900, None), (2500, None), (5000, None), (6000, 12)], rank, 12)
    assert got == (Group(900, 4, 1, 4), Group(2500, 12, 3, 4), Group(5000, 24, 6, 4),
                   Group(6000, 48, 12, 4))
    with pytest.raises(ConfigError, match="over one rank's 1000"):
        given_groups([(4000, 2)], rank, 12)
    with pytest.raises(ConfigError, match="needs more than the 12 ranks' 12000 tokens"):
        given_groups([(13000, None)], rank, 12)
    with pytest.raises(ConfigError, match="does not divide --dp 12"):
        given_groups([(4000, 5)], rank, 12)


def test_groups_take_only_the_sp_degrees_the_model_splits_over():
    # Qwen2-VL-2B's 12 query and 2 key/value heads: SP 8 does not split them, 4 does
    refusal = lambda sp: sequence_parallel_refusal(LLMConfig(heads=12, kv_heads=2), sp)  # noqa
    rank = Caps(4, 1000)
    assert given_groups([(3500, None)], rank, 8, refusal) == (Group(3500, 16, 4, 4),)
    # dp 12: SP 3 splits the 12 query heads but not the 2 key/value heads; 6 does both
    assert [g.sp for g in given_groups([(2500, None), (5000, None)], rank, 12, refusal)] == [4, 6]
    with pytest.raises(ConfigError, match="cannot take SP 8: its 12 query"):
        given_groups([(8000, 8)], rank, 8, refusal)
    with pytest.raises(ConfigError, match="needs more than the 8 ranks' 8000 tokens"):
        given_groups([(5000, None)], rank, 8, refusal)  # 8 would hold it, but cannot split
    lengths = long_tail(2000)
    assert [g.sp for g in ladder(lengths, Caps(2, 512), 8, refusal)] == [1, 2, 4]


def test_a_sample_goes_to_the_smallest_group_that_holds_it():
    lengths = Lengths(np.array([2, 2, 6, 1, 20]), np.array([50, 150, 90, 500, 100]),
                      np.zeros(5, np.int32), ("a",))
    groups = (Group(100, 4, 1, 4), Group(400, 16, 2, 8))
    # by hand: (2, 50) fits 100/4; (2, 150) and (6, 90) need the second; (1, 500) and
    # (20, 100) fit neither
    assert assign(lengths, np.arange(5), groups).tolist() == [0, 1, 1, -1, -1]


def test_mixed_order_spreads_each_group_over_the_epoch_and_short_first_goes_in_turn():
    # by hand: keys 1/8, 3/8, 5/8, 7/8 (group 0) and 1/4, 3/4 (group 1)
    assert order_steps([4, 2], "mixed").tolist() == [0, 1, 0, 0, 1, 0]
    assert order_steps([4, 2], "short-first").tolist() == [0, 0, 0, 0, 1, 1]
    assert order_steps([0, 3], "mixed").tolist() == [1, 1, 1]
    steps = [37, 11, 5]
    order = order_steps(steps, "mixed")
    assert np.bincount(order).tolist() == steps
    share = np.array(steps) / sum(steps)
    for prefix in range(1, len(order) + 1):
        seen = np.bincount(order[:prefix], minlength=3)
        assert np.all(np.abs(seen - prefix * share) <= 1.5), prefix


def _micro_batches(packing: Packing):
    for b in range(packing.n_micro):
        yield b, packing.items[packing.offsets[b]:packing.offsets[b + 1]]


@pytest.mark.parametrize("order", ["mixed", "short-first"])
def test_grouped_packing_keeps_every_sample_and_every_groups_caps(order):
    lengths = long_tail(6000)
    groups = (Group(512, 2, 1, 2), Group(1024, 4, 2, 2), Group(4096, 16, 8, 2))
    ids = np.arange(len(lengths))
    packed = pack_groups(lengths, ids, groups, ranks=8, micro_batches=2, seed=3, cost=COST,
                         mode="padding-free", order=order)
    placed = np.concatenate([p.items for p in packed.packings])
    # counts reconcile: every sample placed once or unplaced once
    assert sorted(np.r_[placed, packed.unplaced].tolist()) == ids.tolist()
    assert len(packed.unplaced_reason) == len(packed.unplaced)
    for g, (group, packing) in enumerate(zip(groups, packed.packings)):
        assert packing.ranks == 8 // group.sp and packing.micro_batches == 2
        assert packing.n_micro == packing.steps * packing.ranks * 2
        assert (packed.order == g).sum() == packing.steps
        for _, items in _micro_batches(packing):
            assert 0 < len(items)
            assert lengths.tiles[items].sum() <= group.qv
            assert lengths.tokens[items].sum() <= group.length
            for i in items:  # the smallest group that holds it, by a loop of its own
                smallest = next(k for k, h in enumerate(groups)
                                if lengths.tiles[i] <= h.qv and lengths.tokens[i] <= h.length)
                assert smallest == g
    assert all(p.steps > 0 for p in packed.packings)
    if order == "short-first":
        assert np.all(np.diff(packed.order) >= 0)
    again = pack_groups(lengths, ids, groups, ranks=8, micro_batches=2, seed=3, cost=COST,
                        mode="padding-free", order=order)
    assert all(np.array_equal(a.items, b.items) for a, b in zip(packed.packings, again.packings))


def _random_media(rng) -> list[tuple[int, int]]:
    """A sample's media as (tiles, units): up to 4 images of 1-6 tiles, and in one sample of
    ten a clip of 2-8 temporal steps of 1-6 tiles each."""
    media = [(int(t), 1) for t in rng.integers(1, 7, rng.integers(0, 5))]
    if rng.random() < 0.1:
        steps, step_tiles = int(rng.integers(2, 9)), int(rng.integers(1, 7))
        media.append((steps * step_tiles, steps))
    return media


def test_no_rank_of_a_group_encodes_more_tiles_than_its_bound():
    """ViT units (an image, a clip's temporal step) are dealt whole to a group's ranks (as the
    loader deals them): with samples of random images and clips, every SP micro-batch's deal,
    loads counted here, keeps each rank within the group's ``rank_qv`` (what the trainer's
    memory check takes); clips over one rank's 8 tiles are placed, spread over the group; an
    image over one rank's 8 tiles is not placed, with its reason."""
    rng = np.random.default_rng(0)
    media = [_random_media(rng) for _ in range(3000)] + [[(9, 1)]]
    tiles = np.array([sum(t for t, _ in m) for m in media])
    largest = np.array([max((t // u for t, u in m), default=0) for m in media])
    tokens = np.maximum(tiles * 16, 8) + rng.integers(0, 40, len(media))
    lengths = Lengths(tiles, tokens, np.zeros(len(media), np.int32), ("a",), largest)
    rank = Caps(8, 128)
    groups = given_groups([(128, 1), (256, 2), (512, 4)], rank, 8, largest=6)
    # by hand, qv/s + (1 - 1/s)·6 rounded up: 8; 8 + 3 = 11; 8 + 4.5 → 13
    assert [(g.qv, g.rank_qv) for g in groups] == [(8, 8), (16, 11), (32, 13)]
    ids = np.arange(len(media))
    packed = pack_groups(lengths, ids, groups, ranks=8, micro_batches=1, seed=1, cost=COST,
                         mode="padding-free", order="mixed")
    assert packed.unplaced_reason[list(packed.unplaced).index(3000)] == "unit_over_rank_qv"
    big = groups[-1]  # what else is unplaced breaks the largest group's caps, by hand
    for i, reason in zip(packed.unplaced, packed.unplaced_reason):
        if reason == "tiles_over_qv":
            assert tiles[i] > big.qv
        elif reason == "tokens_over_qt":
            assert tokens[i] > big.length
        else:
            assert reason in {"unit_over_rank_qv", "remainder"}
    placed = set(np.concatenate([p.items for p in packed.packings]).tolist())
    assert any(tiles[i] > rank.qv and any(u > 1 for _, u in media[i]) for i in placed)
    over_share = 0
    for group, packing in zip(groups, packed.packings):
        for _, items in _micro_batches(packing):
            sizes = [m for i in items for m in media[i]]
            pieces = media_pieces(sizes, group.sp)
            assert [sum(p.tiles for p in pieces if p.medium == k)
                    for k in range(len(sizes))] == [t for t, _ in sizes]
            loads = [sum(p.tiles for p in pieces if p.owner == r) for r in range(group.sp)]
            assert max(loads, default=0) <= group.rank_qv
            over_share += max(loads, default=0) > rank.qv
    assert over_share > 0  # deals that give a rank more than its share: the bound is needed


@pytest.mark.parametrize("sp,kv_sent", [(2, 2), (4, 4), (6, 6)])
def test_the_exchange_prices_key_value_heads_repeated_to_the_sp_degree(sp, kv_sent):
    """Qwen2-VL-2B: 28 layers of 12 query and 2 key/value heads of 128. Per token of a share, a
    step sends q, k, v and the output forward and their gradients back, 2 bytes each (bf16);
    at SP above 2 each key/value head is repeated to SP heads before the exchange
    (``Exchange.heads_to_sequence``), and (SP − 1)/SP of it leaves the rank."""
    from vlmshard.hardware import GPUS, REFERENCE_GPU, flops_per_sp_byte

    hand = 2 * 2 * 28 * (2 * 12 + 2 * kv_sent) * 128 * (sp - 1) / sp
    cost = CostModel.from_sizes(presets()["qwen2-vl-2b"])
    assert cost.sp_exchange(1.0, sp) == pytest.approx(
        hand * flops_per_sp_byte(GPUS[REFERENCE_GPU]), rel=1e-12)


def test_sequence_parallel_steps_pay_the_exchange_and_count_in_the_communication_ratio():
    cost = CostModel(a_v=1.0, a_t=2.0, b=0.0, origin="hand", c_sp=1.0)
    lengths = Lengths(np.array([1, 1, 2, 0, 3, 1]), np.array([10, 20, 30, 40, 100, 60]),
                      np.zeros(6, np.int32), ("a",))
    # group 0 (sp 1, 2 ranks): one step, micro-batches [0, 1] and [2, 3]
    short = Packing(np.array([0, 1, 2, 3]), np.array([0, 2, 4]), 2, 1, np.array([], np.int64), [])
    # group 1 (sp 2, one group of 2 ranks): one step, micro-batch [4, 5]
    long = Packing(np.array([4, 5]), np.array([0, 2]), 1, 1, np.array([], np.int64), [])
    packed = GroupedPacking((Group(100, 4, 1, 4), Group(200, 8, 2, 4)), [short, long],
                            np.array([1, 0]), np.array([], np.int64), [])
    whole, each = packed.measure(lengths, cost, 2, "padding-free")
    # by hand, C = tiles + 2 tokens: group 0 ranks 2 + 60 = 62 and 2 + 140 = 142, spent 2·142;
    # group 1: 4 + 320 = 324, the exchange 1·160·(2 − 1)/2 = 80, spent 1·(324 + 80)
    assert each[0].step_efficiency == pytest.approx((62 + 142) / (2 * 142))
    assert each[1].step_efficiency == pytest.approx(324 / 404)
    assert whole.step_efficiency == pytest.approx((62 + 142 + 324) / (2 * 142 + 404))
    assert whole.communication_ratio == pytest.approx(160 / 260)
    assert each[0].communication_ratio == 0 and each[1].communication_ratio == 1
    # per real rank: group 0's 62 and 142, group 1's 324 over 2 ranks: 162 each
    assert whole.cost_efficiency == pytest.approx((102 + 162) / (142 + 162))
    assert (whole.steps, whole.micro_batches, whole.samples) == (2, 3, 6)


def test_auto_groups_choose_the_best_candidate_and_keep_the_top_level():
    lengths = long_tail(4000, seed=1)
    groups, tried = search_groups(lengths, Caps(2, 512), dp=8, ranks=8, micro_batches=1,
                                  seed=0, cost=COST, mode="padding-free")
    # the ladder: 512 x 1, 1024 x 2, 2048 x 4, 4096 x 8; the longest sample needs the last
    assert groups[-1] == Group(4096, 16, 8, 2)
    assert {"length": 4096, "qv": 16, "sp": 8, "rank_qv": 2} == tried[0]["groups"][-1]
    assert len(tried) == 8 and all(t["groups"][-1]["sp"] == 8 for t in tried)
    best = max(t["step_efficiency"] for t in tried)
    chosen = next(t for t in tried if [g["length"] for g in t["groups"]]
                  == [g.length for g in groups])
    assert chosen["step_efficiency"] >= best - 0.001
    one_cap = next(t for t in tried if len(t["groups"]) == 1)
    assert one_cap["communication_ratio"] == 1.0 and chosen["communication_ratio"] < 1.0


def test_pack_groups_writes_the_groups_and_each_steps_group(tmp_path):
    stats = write_length_file(tmp_path / "lengths.json", long_tail(3000, seed=2))
    out = tmp_path / "plan"
    args = ("pack", "--stats", stats, "--dp", "8", "--out", str(out), "--groups", "512,1024,4096",
            "--max-qt", "512", "--max-qv", "2", "--micro-batches", "2")
    printed = vlmshard(*args).stdout
    assert "communication_ratio" in printed and "step_eff" in printed
    info = json.loads((out / "plan.json").read_text())
    assert [(g["length"], g["sp"], g["qv"], g["dp"]) for g in info["groups"]] == [
        (512, 1, 2, 8), (1024, 2, 4, 4), (4096, 8, 16, 1)]
    plan = pq.read_table(out / "plan.parquet").to_pandas()
    assert list(plan.columns) == ["step", "rank", "micro", "slot", "sample_id", "group"]
    per_step = plan.groupby("step")["group"].agg(["min", "max"])
    assert (per_step["min"] == per_step["max"]).all()  # each step is one group's
    for g, group in enumerate(info["groups"]):
        rows = plan[plan["group"] == g]
        assert rows["step"].nunique() == group["steps"] and len(rows) == group["samples"]
        assert set(rows["rank"]) <= set(range(group["dp"]))
        assert rows.groupby("step").apply(lambda s: len(set(zip(s["rank"], s["micro"])))).eq(
            group["dp"] * 2).all()
    assert info["metrics"]["samples"] == len(plan) == 3000 - len(info["unplaced"])
    # each group's balance over its SP ranks: the LLM's shares of ceil(n/sp), counted here from
    # plan.parquet; the ViT's unknown without media sizes (an OmniBal length file)
    tokens = load_stats(stats).lengths.tokens
    for g, group in enumerate(info["groups"]):
        sp = group["sp"]
        n = plan[plan["group"] == g].groupby(["step", "rank", "micro"])["sample_id"].apply(
            lambda ids: int(tokens[ids.to_numpy()].sum())).to_numpy()
        assert group["llm_rank_balance"] == pytest.approx((-(-n // sp)).sum() / (n.sum() / sp))
        assert group["vit_rank_balance"] == (1.0 if sp == 1 else None)
    # read back, the plan measures as pack measured it
    _, read = read_grouped_plan(str(out))
    again, _ = read.measure(load_stats(stats).lengths, CostModel(**info["cost_model"]), 8,
                            "padding-free")
    assert {**again.to_dict(), "pack_seconds": 0} == {**info["metrics"], "pack_seconds": 0}
    first = (out / "plan.parquet").read_bytes()
    run_pack(PackConfig(stats=stats, dp=8, out=str(tmp_path / "again"), groups="512,1024,4096",
                        max_qt=512, max_qv=2, micro_batches=2))
    assert (tmp_path / "again" / "plan.parquet").read_bytes() == first
    # the report shows each group's figures as plan.json records them
    report = json.loads(vlmshard("report", str(out), "--json").stdout)["plans"][0]
    assert report["groups"] == info["groups"]
    assert report["metrics"]["communication_ratio"] == info["metrics"]["communication_ratio"]
    assert "group 2" in vlmshard("report", str(out)).stdout
    # what reads one-group plans only says so in one line
    report = vlmshard("simulate", str(out), check=False)
    assert report.returncode != 0 and "3 packing group(s)" in report.stderr


@pytest.mark.parametrize("args, says", [
    (("--groups", "1024:3"), "SP degree 3 does not divide --dp 4"),
    (("--groups", "auto", "--algo", "isf"), "--groups packs with --algo balanced"),
    (("--groups", "512,256"), "shortest first"),
    (("--groups", "9000", "--max-qt", "512"), "needs more than the 4 ranks' 2048 tokens"),
])
def test_bad_groups_are_refused_before_packing(tmp_path, args, says):
    stats = write_length_file(tmp_path / "lengths.json", long_tail(200))
    result = vlmshard("pack", "--stats", stats, "--dp", "4", "--out", str(tmp_path / "plan"),
                      *args, check=False)
    assert result.returncode != 0 and says in result.stderr
    assert not os.path.exists(tmp_path / "plan" / "plan.json")


# --- groups place what plain packing places; a plan may leave out only so many ---------------

@pytest.mark.parametrize("caps", [(), ("--max-qt", "2000")])
def test_auto_groups_without_caps_place_every_sample_plain_pack_places(tmp_path, caps):
    """One rank's default caps are plain pack's, never below the largest sample: with no caps
    or a token cap alone, every image sample finds a rank that encodes it."""
    stats = write_length_file(tmp_path / "lengths.json", mostly_text())
    plain = tmp_path / "plain"
    vlmshard("pack", "--stats", stats, "--dp", "2", "--out", str(plain))
    grouped = tmp_path / "grouped"
    vlmshard("pack", "--stats", stats, "--dp", "2", "--out", str(grouped), "--groups", "auto",
             *caps)
    placed = {d: set(pq.read_table(d / "plan.parquet")["sample_id"].to_pylist())
              for d in (plain, grouped)}
    assert placed[grouped] == placed[plain] == set(range(205))
    info = json.loads((grouped / "plan.json").read_text())
    # one rank holds the 20-tile images (4 mean samples hold 4 x 60 / 205: 1 tile)
    assert info["caps_search"]["rank_bound"]["qv"] == 20


RULE = "more than --max-unplaced-ratio 0.01"


@pytest.mark.parametrize("args, says, fixed", [
    (("--dp", "2", "--qv", "10", "--qt", "3000"),
     "5 of 205 samples (2.4%) out over the caps, " + RULE + ": 3 over Qv 10 (tiles_over_qv), 2 "
     "over Qt 3000 (tokens_over_qt); to place them, raise --qv to 20 and --qt to 3500",
     ("--dp", "2", "--qv", "20", "--qt", "3500")),
    (("--dp", "2", "--max-qv", "10", "--max-qt", "3000"),
     "5 of 205 samples (2.4%) out over the caps, " + RULE + ": 3 over Qv 10 (tiles_over_qv), 2 "
     "over Qt 3000 (tokens_over_qt); to place them, raise --max-qv to 20 and --max-qt to 3500",
     ("--dp", "2", "--max-qv", "20", "--max-qt", "3500")),
    # ladder 1000:1 (5 tiles), 2000:2 (10 tiles): the images need 20 / 2 tiles a rank, the long
    # texts 3500 / 2 tokens
    (("--dp", "2", "--groups", "auto", "--max-qv", "5", "--max-qt", "1000"),
     "5 of 205 samples (2.4%) out over the caps, " + RULE + ": 3 over the largest group's Qv 10 "
     "(tiles_over_qv), 2 over the largest group's Qt 2000 (tokens_over_qt); to place them, "
     "raise --max-qv to 10 and --max-qt to 1750",
     ("--dp", "2", "--groups", "auto", "--max-qv", "10", "--max-qt", "1750")),
    # 1000:1 and 2000:2 of 4 ranks; 3500 takes SP 4
    (("--dp", "4", "--groups", "1000,2000", "--max-qv", "5", "--max-qt", "1000"),
     "5 of 205 samples (2.4%) out over the caps, " + RULE + ": 3 over the largest group's Qv 10 "
     "(tiles_over_qv), 2 over the largest group's Qt 2000 (tokens_over_qt); to place them, "
     "raise --max-qv to 10 and the largest --groups length to 3500",
     ("--dp", "4", "--groups", "1000,3500", "--max-qv", "10", "--max-qt", "1000")),
])
def test_a_plan_leaving_out_more_than_the_ratio_names_the_caps_to_raise(tmp_path, args, says,
                                                                       fixed):
    """Plain or grouped, a plan that leaves more than --max-unplaced-ratio of the samples over
    a cap is not written: one line says how many break which cap and the values that place
    them, and those values leave no sample over a cap."""
    stats = write_length_file(tmp_path / "lengths.json", mostly_text())
    common = ("pack", "--stats", stats, "--out")
    out = tmp_path / "plan"
    proc = vlmshard(*common, str(out), *args, check=False)
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1] == (
        f"vlmshard pack: error: the plan leaves {says}, or raise --max-unplaced-ratio (no plan "
        f"written to {out})")
    assert not (out / "plan.json").exists()
    vlmshard(*common, str(tmp_path / "fixed"), *fixed)
    info = json.loads((tmp_path / "fixed" / "plan.json").read_text())
    assert set(info["unplaced_by_reason"]) <= {"remainder"}
    # within the ratio, the plan is written with the samples left out, and a warning
    proc = vlmshard(*common, str(out), *args, "--max-unplaced-ratio", "0.025")
    assert "5 samples exceed the caps on their own and are not placed" in proc.stderr
    assert json.loads((out / "plan.json").read_text())["metrics"]["unplaced"] >= 5


def test_isf_caps_that_leave_samples_out_name_the_caps_that_place_them(tmp_path):
    """isf's searched caps (OmniBal's search for 4 samples a group) leave the images and the
    long texts out: the one line names the --qv/--qt to give instead."""
    stats = write_length_file(tmp_path / "lengths.json", mostly_text())
    proc = vlmshard("pack", "--stats", stats, "--dp", "4", "--out", str(tmp_path / "isf"),
                    "--algo", "isf", check=False)
    assert proc.returncode == 1
    found = re.search(r"error: the plan leaves 5 of 205 samples \(2\.4%\) out over the caps, "
                      r"more than --max-unplaced-ratio 0\.01: 3 over Qv (\d+) \(tiles_over_qv\), "
                      r"2 over Qt (\d+) \(tokens_over_qt\); to place them, give isf --qv 20 "
                      r"--qt 3500, or raise", proc.stderr)
    assert found and int(found[1]) < 20 and int(found[2]) < 3500, proc.stderr


def test_a_groups_rank_balance_is_its_fullest_rank_over_the_mean_by_hand():
    """Two SP-2 micro-batches: a clip of 4 steps of 3 tiles beside an image of 5 (101 tokens),
    then an image of 4 (10 tokens). Dealt by hand, largest unit first to the least loaded:
    5 -> r0; 3 -> r1, r1 (3 < 5), r0 (5 < 6), r1 (6 < 8): loads 8 and 9; then 4 and 0. The
    ViT: (9 + 4) / (8.5 + 2); the LLM's contiguous shares: (51 + 5) / (50.5 + 5)."""
    media = MediaUnits(np.array([0, 2, 3]), np.array([12, 5, 4]), np.array([4, 1, 1]))
    lengths = Lengths(np.array([17, 4]), np.array([101, 10]), np.zeros(2, np.int32), ("a",))
    packing = Packing(np.array([0, 1]), np.array([0, 1, 2]), 1, 1, np.array([], np.int64), [])
    vit, llm = rank_balance(packing, media, lengths, 2)
    assert vit == pytest.approx(13 / 10.5)
    assert llm == pytest.approx(56 / 55.5)
    assert rank_balance(packing, None, lengths, 2)[0] is None
