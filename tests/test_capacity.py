"""What a device holds before any profile (``vlmshard.train.capacity``): the bounds a plan for
that device is packed under, and the random micro-batch's samples inside them."""

from __future__ import annotations


import numpy as np

from vlmshard.demo.data import demo_model, generate
from vlmshard.packing.config import PackConfig
from vlmshard.packing.plan import load_plan, run_pack
from vlmshard.packing.stats import load_stats
from vlmshard.preprocess import PreprocessConfig, run_preprocess
from vlmshard.train.capacity import device_capacity

# The smoke model of benchmarks/gpu_bench.py on a device of 1.37 GiB, 1.25 of it the CUDA
# context's and NCCL's: a few of its samples a micro-batch
DEVICE_BYTES = int(1.37 * 2**30)


def test_a_device_bounds_random_samples_and_balanced_caps(tmp_path):
    """Random takes as many samples as keep that many of the largest sample (its padded caps,
    counted here by hand) inside the recompute-free bound; balanced packed up to that bound
    places every sample within it, in micro-batches random's caps would not hold."""
    data = generate(str(tmp_path / "data"), seed=0, scale=1)
    model = demo_model("qwen3_vl", str(tmp_path / "model"), max_pixels=32 * 32 * 64)
    pre = str(tmp_path / "pre")
    run_preprocess(PreprocessConfig(inputs=[data.meta], out=pre, model=model, keep_tokens=True,
                                    max_seq_len=8192, part_size=256))
    capacity = device_capacity(model, pre, DEVICE_BYTES)
    free, whole = capacity.recompute_free, capacity.whole
    assert free.max_qv <= whole.max_qv and free.max_qt <= whole.max_qt

    lengths = load_stats(pre).lengths
    tiles, tokens = int(lengths.tiles.max()), int(lengths.tokens.max())
    fits = lambda k: k * tiles <= free.max_qv and k * tokens <= free.max_qt  # noqa: E731
    assert free.samples >= 2 and fits(free.samples) and not fits(free.samples + 1)

    plan = str(tmp_path / "plan")
    run_pack(PackConfig(stats=pre, dp=1, out=plan, algo="balanced", micro_batches=2,
                        target_samples=free.samples, max_qv=free.max_qv, max_qt=free.max_qt))
    _, packing, _ = load_plan(plan)
    assert set(packing.unplaced_reason) <= {"remainder"}
    assert sorted([*packing.items, *packing.unplaced]) == list(range(len(lengths.tiles)))
    sizes = [(int(lengths.tiles[m].sum()), int(lengths.tokens[m].sum()))
             for m in np.split(packing.items, packing.offsets[1:-1])]
    assert all(t <= free.max_qv and k <= free.max_qt for t, k in sizes)
    assert any(t > free.samples * tiles or k > free.samples * tokens for t, k in sizes)
