"""Shared fixtures: the demo dataset (generated from scikit-image's photos, no ../shared needed)."""

from __future__ import annotations

import pytest

from preprocess.demo_data import DemoDataset, generate

@pytest.fixture(scope="session")
def demo(tmp_path_factory) -> DemoDataset:
    return generate(str(tmp_path_factory.mktemp("demo")), seed=0)
