"""The order metric's ranks against SciPy's, the reference implementation (the library avoids
importing SciPy: that import alone took longer than packing)."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from scipy.stats import rankdata, spearmanr

from vlmshard.packing.metrics import average_ranks, spearman

values = st.lists(st.integers(0, 6), min_size=2, max_size=200)


@given(values)
def test_average_ranks_equal_scipys(xs):
    x = np.array(xs, dtype=np.float64)
    np.testing.assert_array_equal(average_ranks(x), rankdata(x))


@given(values, st.integers(0, 2**31))
def test_spearman_equals_scipys(xs, seed):
    x = np.array(xs, dtype=np.float64)
    y = np.random.default_rng(seed).random(len(x))
    expected = spearmanr(x, y)[0] if x.std() > 0 else 0.0  # SciPy gives nan for constant input
    assert abs(spearman(x, y) - expected) < 1e-12
