"""What the examples share: their common options, and the ``--smoke`` set-up (shards and a model
folder made offline: the demo's Hub-style source, Parquet with embedded images, a tiny model of
the demo with random weights, packed for 2 ranks, 2 samples a micro-batch: attention over a
packed micro-batch on CPU grows with its length squared; about 15 seconds on 2 CPUs), made in a
temporary folder that is removed when the example ends."""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from typing import Iterator


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", help="a shard folder written by vlmshard write")
    p.add_argument("--model", help="the Hugging Face model folder the shards were made for")
    p.add_argument("--smoke", action="store_true", help="make a tiny demo model and shards")
    p.add_argument("--family", default="internvl", help="--smoke's model_type")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--attn", default="sdpa",
                   help="attn_implementation (flash_attention_2 on GPUs; without flash-attn, "
                        "vlmshard_torch_varlen_as_flash: the same on torch's varlen kernel)")
    return p


@contextlib.contextmanager
def model_and_shards(args: argparse.Namespace, p: argparse.ArgumentParser
                     ) -> Iterator[tuple[str, str]]:
    """(model folder, shard folder) while the ``with`` lasts: the options', or ``--smoke``'s,
    made in a temporary folder removed afterwards."""
    if not args.smoke:
        if not (args.model and args.shards):
            p.error("give --shards and --model, or --smoke")
        yield args.model, args.shards
        return
    with tempfile.TemporaryDirectory(prefix="vlmshard-smoke-") as root:
        yield smoke_setup(root, args.family)


def smoke_setup(root: str, model_type: str = "internvl") -> tuple[str, str]:
    """(model folder, shard folder) under ``root``, built once."""
    from vlmshard.packing.config import PackConfig
    from vlmshard.packing.plan import run_pack
    from vlmshard.preprocess import PreprocessConfig, run_preprocess
    from vlmshard.demo.data import demo_model, generate
    from vlmshard.shards.config import WriteConfig
    from vlmshard.shards.writer import run_write

    data = generate(os.path.join(root, "data"))
    folder = demo_model(model_type, os.path.join(root, f"model-{model_type}"))
    pre, plan, shards = (os.path.join(root, f"{name}-{model_type}")
                         for name in ("preprocess", "plan", "shards"))
    # InternVL's images at most two tiles: a packed micro-batch of two samples stays ~2k tokens,
    # where the folder's six made ~7k, and the model's sdpa attends over the whole packed
    # sequence under a mask on CPU (quadratic in its length: 80% of a step's time at 7k)
    tiles = {"max_patches": 2} if model_type == "internvl" else {}
    run_preprocess(PreprocessConfig(inputs=[os.path.join(data.root, data.sources["hub"])],
                                    out=pre, model=folder, workers=1, **tiles))
    run_pack(PackConfig(stats=pre, dp=2, out=plan, target_samples=2))
    run_write(WriteConfig(plan=plan, stats=pre, out=shards, workers=1))
    return folder, shards
