"""``vlmshard pack --cost-model RUN``: a cost model refit from a training run's own log. On a
log written by the trainer's record functions from known coefficients the refit finds them;
on a real CPU run packed with a cost model 50x wrong on the ViT, the refit is the
non-negative least squares of the run's logged rows computed here, and the plan it packs
spreads its steps less under it than the run's own plan."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from helpers import vlmshard, vlmshard_here
from hf_reference import make_folder
from PIL import Image

from vlmshard.families import presets
from vlmshard.io import read_json
from vlmshard.model_sizes import CostTerms
from vlmshard.packing.cost import CostModel, fit_coefficients
from vlmshard.preprocess import PreprocessConfig, run_preprocess
from vlmshard.preprocess.tokenize import IGNORE_INDEX
from vlmshard.run_log import PIPELINE_NAME
from vlmshard.shards.config import WriteConfig
from vlmshard.shards.writer import run_write
from vlmshard.train.train_log import pipeline_record, rank_data, rank_timing, step_record

META = os.path.join(os.path.dirname(__file__), "data", "omnibal", "meta.json")
MODEL = presets()["internvl2-2b"]
TRUE = {"a_v": 2e-4, "a_t": 3e-5, "b": 4e-9, "a_s": 5e-6}  # seconds


def _batch(rng: np.random.Generator) -> dict:
    """A loader micro-batch of 1-4 samples as the log's records read it: tiles, lengths and
    labels, some tokens unsupervised."""
    lens = rng.integers(50, 2000, rng.integers(1, 5))
    labels = np.where(rng.random(int(lens.sum())) < 0.4, 7, IGNORE_INDEX)
    return {"step": 0, "sample_ids": np.arange(len(lens)), "num_tokens": int(lens.sum()),
            "num_tiles": int(rng.integers(0, 300)), "num_samples": len(lens),
            "cu_seqlens": np.r_[0, np.cumsum(lens)], "labels": labels}


def _parts(sizes: list[dict], stage: int) -> dict:
    """Stage 0 (ViT and projector) and stage 1 (LLM and head) of a replica computing ``sizes``
    at TRUE: a tenth of the ViT's time is the projector's."""
    t = {k: sum(s[k] for s in sizes) for k in ("tiles", "tokens", "squares", "supervised")}
    vit = TRUE["a_v"] * t["tiles"]
    if stage == 0:
        return {"vit": 0.9 * vit, "projector": 0.1 * vit, "llm": 0.0, "head": 0.0}
    return {"vit": 0.0, "projector": 0.0, "llm": TRUE["a_t"] * t["tokens"] + TRUE["b"] * t[
        "squares"], "head": TRUE["a_s"] * t["supervised"]}


def write_run(folder: Path, steps: int = 8, dp: int = 2) -> None:
    """A run of MODEL at PP 2, DP ``dp`` whose parts take TRUE's seconds, by the trainer's record
    functions; its first (warm-up), a traced and a sequence-parallel step take 10x as long."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "train_log.jsonl", "w", encoding="utf-8") as f:
        for step in range(steps):
            slow = 10.0 if step in (0, 3, 5) else 1.0
            ranks = []
            for d in range(dp):
                data = rank_data([_batch(rng) for _ in range(2)], MODEL)
                for stage in range(2):
                    parts = {k: slow * v for k, v in _parts(data["micro_sizes"], stage).items()}
                    busy = sum(parts.values())
                    timing = rank_timing(rank=stage * dp + d, stage=stage, dp_rank=d,
                                         forward_s=busy / 3, backward_s=2 * busy / 3,
                                         pipeline_s=busy, step_time_s=busy, parts=parts)
                    if stage == 0:
                        timing["data"] = data
                    ranks.append(timing)
            record = step_record(step, 2.0, 1e-5, ranks, CostTerms())
            record["sp"] = 2 if step == 5 else 1
            if step == 3:
                record["traced"] = True
            f.write(json.dumps(record) + "\n")
    stages = [(0, ["vit_embed", "projector"], [], []), (1, ["llm_block_0", "head"], [], [])]
    (folder / PIPELINE_NAME).write_text(json.dumps(pipeline_record(MODEL.to_dict(), stages)))


def test_a_refit_finds_the_coefficients_the_runs_times_were_made_of(tmp_path):
    """Each replica's parts summed over its stages, the ViT's with the projector's, the head
    apart; the warm-up, traced and sequence-parallel steps (10x slower) left out: 5 steps x 2
    ranks, fitted exactly."""
    write_run(tmp_path / "run")
    refit = CostModel.from_run(str(tmp_path / "run"))
    assert {k: getattr(refit, k) for k in TRUE} == pytest.approx(TRUE, rel=1e-6)
    assert refit.origin == f"run:{tmp_path / 'run'}"
    assert refit.fit["rows"] == 10 and refit.fit["rms_error"] < 1e-6
    assert (refit.window, refit.window_share, refit.c_sp) == (0, 0.0, 0.0)


def test_a_vits_attention_across_units_is_fitted_where_the_rows_tell_it_apart():
    """Rows of a Qwen ViT (4 patches a tile: its logged Σ P² is 16·Σ tiles²) timed at a_v 2e-4
    and a_vs 3e-6 s are fitted to both; rows whose tiles and tiles² keep one proportion to a_v
    alone, the least squares of time on tiles."""
    rows = [{"tiles": t, "vit_squares": 16 * u, "vit_s": 2e-4 * t + 3e-6 * u, "tokens": 10,
             "squares": 100, "llm_s": 1.0} for t, u in ((10, 50), (20, 400), (30, 300))]
    fitted = fit_coefficients(rows, patches_per_tile=4)
    assert (fitted["a_v"], fitted["a_vs"]) == pytest.approx((2e-4, 3e-6), rel=1e-9)
    same = [{**r, "tiles": 2 * r["tiles"], "vit_squares": 2 * r["vit_squares"]}
            for r in (rows[0], rows[0])] + [rows[0]]
    fitted = fit_coefficients(same, patches_per_tile=4)
    tiles = np.array([r["tiles"] for r in same], float)
    time = np.array([r["vit_s"] for r in same])
    assert "a_vs" not in fitted and fitted["a_v"] == pytest.approx(tiles @ time / (tiles @ tiles))


def test_a_run_with_too_few_steps_to_fit_says_so(tmp_path):
    write_run(tmp_path / "run", steps=2)
    out = vlmshard("pack", "--stats", META, "--dp", "2", "--cost-model", str(tmp_path / "run"),
                   "--out", str(tmp_path / "plan"), check=False)
    assert out.returncode != 0
    assert "2 step(s) x data-parallel ranks after the warm-up step: too few" in out.stderr


def test_pack_takes_a_runs_folder_and_report_shows_its_refit(tmp_path):
    """plan.json's cost model is the refit (origin run:PATH, its rows and error); the report
    shows it beside the FLOPs model of a plan packed without it."""
    write_run(tmp_path / "run")
    vlmshard_here("pack", "--stats", META, "--dp", "2", "--cost-model", str(tmp_path / "run"),
                  "--out", str(tmp_path / "refit"))
    vlmshard_here("pack", "--stats", META, "--dp", "2", "--out", str(tmp_path / "flops"))
    cost = read_json(tmp_path / "refit" / "plan.json")["cost_model"]
    assert cost["origin"] == f"run:{tmp_path / 'run'}" and cost["fit"]["rows"] == 10
    assert {k: cost[k] for k in TRUE} == pytest.approx(TRUE, rel=1e-6)
    stdout = vlmshard("report", str(tmp_path / "refit"), str(tmp_path / "flops")).stdout
    table = stdout[stdout.index("\ncost model") + 1:].splitlines()
    assert table[1].split()[1:] == [f"run:{tmp_path / 'run'}", "flops:internvl2-2b"]
    a_v = next(line for line in table if line.startswith("a_v / a_t")).split()
    assert float(a_v[3]) == pytest.approx(TRUE["a_v"] / TRUE["a_t"], rel=1e-3)
    assert next(line for line in table if line.startswith("fit")).split()[-2:] == ["0.0%", "-"]


# Four samples (tiles, tokens) no two of which share a micro-batch under Qv 40, Qt 700: one step
# of 2 ranks x 2 micro-batches. The packer deals a step's micro-batches largest cost first in
# snake order (rank 0, 1, 1, 0): the costliest and the cheapest on one rank.
HAND = [(40, 100), (30, 700), (20, 500), (10, 250)]  # A, B, C, D


def _hand_cost(cost: dict, i: int) -> float:
    """Sample i of HAND costed with ``cost`` (supervised: every token; a length file says
    nothing)."""
    v, t = HAND[i]
    return cost["a_v"] * v + (cost["a_t"] + cost["a_s"]) * t + cost["b"] * t * t


def _hand_deal(cost: dict) -> list[list[int]]:
    """The ranks' samples as ``cost`` orders HAND: the 1st and 4th costliest, the 2nd and 3rd."""
    order = sorted(range(len(HAND)), key=lambda i: -_hand_cost(cost, i))
    return sorted([sorted(order[0::3]), sorted(order[1:3])])


def _hand_spread(ranks: list[list[int]], cost: dict) -> float:
    """The busiest rank's cost over the mean rank's, as ``cost`` weighs HAND."""
    loads = [sum(_hand_cost(cost, i) for i in rank) for rank in ranks]
    return max(loads) / np.mean(loads)


def _dealt(plan: Path) -> list[list[int]]:
    """The ranks' samples in plan.parquet's one step, each sorted, in sorted order."""
    ranks: dict[int, list[int]] = {}
    for row in pq.read_table(plan / "plan.parquet").to_pylist():
        assert row["step"] == 0
        ranks.setdefault(row["rank"], []).append(row["sample_id"])
    return sorted(sorted(r) for r in ranks.values())


def _pack_hand(tmp_path: Path, cost_model: str, out: str) -> Path:
    lengths = tmp_path / "hand.json"
    lengths.write_text(json.dumps([{"vit_num": v, "token_num": t} for v, t in HAND]))
    vlmshard_here("pack", "--stats", str(lengths), "--dp", "2", "--micro-batches", "2",
                  "--qv", "40", "--qt", "700", "--cost-model", cost_model,
                  "--out", str(tmp_path / out))
    return tmp_path / out


def test_the_refit_deals_a_step_as_the_runs_times_weigh_it(tmp_path):
    """The hand case packed from the run (TRUE: B 0.0325 s, C 0.0225, A 0.0115, D 0.0110) deals
    B + D against C + A, 0.0435 s against 0.0340: 1.12x the mean; packed with a_v 50x too large
    (A, B, C, D by tiles) A + D against B + C, 0.0225 s against 0.0550: 1.42x."""
    write_run(tmp_path / "run")
    (tmp_path / "wrong.json").write_text(json.dumps({**TRUE, "a_v": 50 * TRUE["a_v"]}))
    refit = _dealt(_pack_hand(tmp_path, str(tmp_path / "run"), "refit"))
    wrong = _dealt(_pack_hand(tmp_path, str(tmp_path / "wrong.json"), "wrong"))
    assert (refit, wrong) == ([[0, 2], [1, 3]], [[0, 3], [1, 2]])
    assert _hand_spread(refit, TRUE) == pytest.approx(0.04346 / 0.03875, rel=1e-3)
    assert _hand_spread(wrong, TRUE) == pytest.approx(0.05496 / 0.03875, rel=1e-3)

# --- a real run on CPU ---------------------------------------------------------------------


def _images_and_rows(root: Path) -> Path:
    """96 chats about images of 4 to 16 merged patches whose answers' lengths vary apart from
    them, so that balancing tiles alone leaves the tokens unbalanced."""
    rows = []
    for i in range(96):
        side = (56, 84, 112)[i % 3]
        Image.new("RGB", (side, side), color=(5 * i, 100, 50)).save(root / f"{i}.png")
        rows.append({"image": f"{i}.png", "conversations": [
            {"from": "human", "value": "<image>\nWhat is shown?"},
            {"from": "gpt", "value": "A photo of a thing. " * (1 + (7 * i) % 11)}]})
    with open(root / "rows.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return root / "rows.jsonl"


def _logged_rows(run: Path) -> list[dict]:
    """Per step after the first and per DP rank (one stage): Σ of the logged micro-batch sizes
    and the rank's logged part times, read here from train_log.jsonl."""
    rows = []
    with open(run / "train_log.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    for record in records[1:]:
        assert record["sp"] == 1 and not record.get("traced")
        for data in record["data"]:
            (rank,) = [r for r in record["ranks"] if r["dp_rank"] == data["dp_rank"]]
            parts = rank["time_breakdown"]
            sums = {k: sum(m[k] for m in data["micro_sizes"])
                    for k in ("tiles", "tokens", "squares", "supervised", "vit_squares")}
            rows.append({**sums, "vit": parts["vit"] + parts["projector"], "llm": parts["llm"],
                         "head": parts["head"]})
    return rows


def _nnls_two(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares of two columns by hand: the unconstrained solution where both
    are >= 0, else the best of zero and each column alone (the only other KKT points)."""
    full = np.linalg.lstsq(x, y, rcond=None)[0]
    if (full >= 0).all():
        return full
    alone = [np.zeros(2)] + [np.eye(2)[j] * max(0.0, x[:, j] @ y / (x[:, j] @ x[:, j]))
                             for j in range(2)]
    return min(alone, key=lambda c: float(np.sum((x @ c - y) ** 2)))


@pytest.mark.slow(minutes=1.5)
def test_a_run_packed_with_a_wrong_model_refits_to_a_plan_that_spreads_less(tmp_path):
    """A tiny Qwen2-VL trained on CPU (DP 2, gloo) on a plan packed with the FLOPs model's a_v
    50x too large; ``pack --cost-model RUN`` refits it. The refit is, within 1e-5, the
    non-negative least squares of the run's logged rows computed here (numpy). Under it the hand
    case's step spreads less packed from the run than from the wrong model. (On the run's own
    data balanced's plans tie: it fills micro-batches on both caps and evens tiles, tokens and
    attention apart, so the model only orders the deal and ranks the caps.)"""
    folder = make_folder("qwen2_vl", str(tmp_path / "model"))
    pre, flops, wrong = tmp_path / "pre", tmp_path / "flops", tmp_path / "wrong"
    run_preprocess(PreprocessConfig(inputs=[str(_images_and_rows(tmp_path))], out=str(pre),
                                    model=folder, workers=1))
    pack = ["pack", "--stats", str(pre), "--dp", "2", "--micro-batches", "2"]
    vlmshard_here(*pack, "--out", str(flops))
    model = read_json(flops / "plan.json")["cost_model"]
    (tmp_path / "wrong.json").write_text(json.dumps(
        {"a_v": 50 * model["a_v"], **{k: model[k] for k in ("a_t", "b", "a_s")}}))
    vlmshard_here(*pack, "--cost-model", str(tmp_path / "wrong.json"), "--out", str(wrong))
    run_write(WriteConfig(plan=str(wrong), stats=str(pre), out=str(tmp_path / "shards"),
                          workers=1))
    run = tmp_path / "run"
    vlmshard_here("train", "--shards", str(tmp_path / "shards"), "--out", str(run), "--pp", "1",
                  "--dp", "2", "--lr", "0.001", "--no-save-checkpoints")
    refit = tmp_path / "refit"
    vlmshard_here(*pack, "--cost-model", str(run), "--out", str(refit))
    fitted = read_json(refit / "plan.json")["cost_model"]
    assert fitted["origin"] == f"run:{run}"

    rows = _logged_rows(run)
    column = lambda k: np.array([r[k] for r in rows], dtype=float)  # noqa: E731
    assert fitted["fit"]["rows"] == len(rows) >= 10
    supervised = column("supervised")
    # Qwen2-VL's ViT attends across each image (its logged Σ P² over 4 patches a tile, as
    # Σ tiles² of its images), but balanced gave every rank of every step the same images: 58
    # tiles, 706 tiles², so the run cannot tell a_vs from a_v and a_v holds both
    tiles = column("tiles")
    assert (tiles == 58).all() and (column("vit_squares") == 706 * 4 ** 2).all()
    assert "a_vs" not in fitted or fitted["a_vs"] == 0.0
    a_t, b = _nnls_two(np.stack([column("tokens"), column("squares")], axis=1), column("llm"))
    hand = {"a_v": column("vit") @ tiles / (tiles @ tiles), "a_t": a_t, "b": b,
            "a_s": column("head") @ supervised / (supervised @ supervised)}
    assert {k: fitted[k] for k in hand} == pytest.approx(hand, rel=1e-5, abs=1e-15)
    # the hand case packed from the run and from its wrong model, each dealt as its model
    # orders the samples; the run's tiles weigh little enough against its tokens to deal
    # otherwise than the wrong model (a measured fact of this run), so its step spreads less
    wrong_model = read_json(tmp_path / "wrong.json")
    wrong_hand = _dealt(_pack_hand(tmp_path, str(tmp_path / "wrong.json"), "hand-wrong"))
    refit_hand = _dealt(_pack_hand(tmp_path, str(run), "hand-refit"))
    assert (refit_hand, wrong_hand) == (_hand_deal(fitted), _hand_deal(wrong_model))
    assert refit_hand != wrong_hand
    assert _hand_spread(refit_hand, fitted) < _hand_spread(wrong_hand, fitted)
