"""The array helpers give numpy's own answers (``np.unique``, ``np.isin``, ``np.lexsort``) on
random integer arrays with repeats, ties, empty inputs and groups beyond 16 bits."""

from __future__ import annotations

import numpy as np
import pytest

from primus_perf.tracelens.arrays import member, order_by_start, unique, unique_pairs


@pytest.mark.parametrize("seed", range(4))
def test_helpers_match_numpy(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(100):
        n = int(rng.integers(0, 200))
        group = rng.integers(0, 4, n) * (100_000 if rng.random() < 0.3 else 1)
        start, dur = rng.integers(0, 15, n).astype(float), rng.integers(0, 4, n).astype(float)
        assert np.array_equal(order_by_start(start, dur, group), np.lexsort((-dur, start, group)))
        assert np.array_equal(order_by_start(start, group=group), np.lexsort((start, group)))
        assert np.array_equal(order_by_start(start, dur), np.lexsort((-dur, start)))
        a, b = rng.integers(0, 30, n), rng.integers(0, 9, n)
        assert np.array_equal(unique(a), np.unique(a))
        ua, ub, inverse = unique_pairs(a, b)
        both, inv = np.unique(np.stack([a, b]), axis=1, return_inverse=True)
        if n:
            assert np.array_equal(ua, both[0]) and np.array_equal(ub, both[1])
        assert np.array_equal(inverse, inv.ravel())
        assert np.array_equal(member(a, b), np.isin(a, b))
    neg = np.array([-3, 5, -3, 2])  # negative values take numpy's own path
    ua, ub, inverse = unique_pairs(neg, neg[::-1])
    assert ua.tolist() == [-3, -3, 2, 5] and ub.tolist() == [2, 5, -3, -3] and inverse.tolist() == [0, 3, 1, 2]
