"""Shared fixtures: the demo dataset (generated from scikit-image's photos, no ../shared needed)."""

from __future__ import annotations

import pytest

from preprocess import PreprocessConfig, run_preprocess
from preprocess.demo_data import DemoDataset, generate


@pytest.fixture(scope="session")
def demo(tmp_path_factory) -> DemoDataset:
    return generate(str(tmp_path_factory.mktemp("demo")), seed=0)


@pytest.fixture(scope="session")
def demo_out(demo, tmp_path_factory):
    """The demo data preprocessed once (tokens kept), as later stages read it."""
    out = tmp_path_factory.mktemp("pre") / "out"
    run_preprocess(PreprocessConfig(inputs=[demo.meta], out=str(out), keep_tokens=True,
                                    workers=1, max_seq_len=8192, part_size=64))
    return out
