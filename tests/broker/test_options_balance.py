"""Option-balanced sampling in the broker's store, and per-option loss weights."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from support.synthetic import random_segment

from zclaw.broker import Store
from zclaw.broker.balance import OptionBalancer
from zclaw.policy import losses
from zclaw.wire.messages import EnvSpec, Segment, parse

SPEC = EnvSpec("test:Dummy-v0", (3,), (2,), (-1.0, -1.0), (1.0, 1.0))


def segment_with_options(option_value_counts, rng, seq=0):
    """A 4 x 2 segment whose 8 steps run the given options, e.g. {0: 6, 1: 2}."""
    a = random_segment(SPEC, 4, 2, rng)
    opts = [o for o, n in option_value_counts.items() for _ in range(n)]
    a["option"][:] = np.array(opts, dtype=np.int32).reshape(4, 2)
    return parse(Segment("w", seq, SPEC.hash, a).frames(), ["segment"])


def test_balancer_weights_by_hand() -> None:
    b = OptionBalancer(3)
    b.insert(0, np.array([[0, 0], [0, 0]]))  # n_0 = 4
    b.insert(1, np.array([[0, 0], [0, 1]]))  # n_0 = 3, n_1 = 1
    b.insert(2, np.array([[0, 2], [2, 2]]))  # n_0 = 1, n_2 = 3 (K grows on the fly)
    # totals n_0 = 8, n_1 = 1, n_2 = 3 ; w = 4/8 ; 3/8 + 1/1 ; 1/8 + 3/3 ; sum = 3
    np.testing.assert_allclose(b.weights(np.array([0, 1, 2])), np.array([0.5, 1.375, 1.125]) / 3)
    b.insert(1, np.array([[2, 2], [2, 2]]))  # the slot is reused: its old counts are gone
    np.testing.assert_allclose(b.weights(np.array([0, 1])), [0.5, 0.5])


def test_option_balanced_store_serves_the_rare_option_more_often() -> None:
    rng = np.random.default_rng(0)
    plain = Store(SPEC, capacity=10, mode="uniform", max_reuse=0, seed=1)
    balanced = Store(SPEC, capacity=10, mode="uniform", max_reuse=0, seed=1, option_balanced=True)
    for i in range(10):  # one segment in ten holds option 1 at all
        counts = {0: 4, 1: 4} if i == 3 else {0: 8}
        for store in (plain, balanced):
            store.insert(segment_with_options(counts, rng, i))
    share = {}
    for name, store in (("plain", plain), ("balanced", balanced)):
        c = Counter()
        for _ in range(400):
            batch = store.sample(1, 0)
            c.update(batch.arrays["option"].ravel().tolist())
            assert np.all(batch.arrays["is_weight"] == 1.0)
        share[name] = c[1] / sum(c.values())
    # P(rare segment): uniform 1/10 ; balanced w = 4/76 + 4/4 vs 8/76 each, so ~ 1.05 / 1.99 ~ 0.53
    assert share["plain"] < 0.1
    assert share["balanced"] > 0.2
    # queue mode too, and every segment still leaves after max_reuse uses
    q = Store(SPEC, capacity=10, mode="queue", max_reuse=1, seed=2, option_balanced=True)
    for i in range(10):
        q.insert(segment_with_options({0: 4, 1: 4} if i == 9 else {0: 8}, rng, i))
    first = q.sample(5, 0)
    assert 9 in first.keys  # the newest segment, rich in option 1, is served among the first, not last
    served = list(first.keys)
    while len(q):
        served += q.sample(1, 0).keys
    assert sorted(served) == list(range(10))


def test_option_loss_weights_by_hand() -> None:
    option = torch.tensor([0, 0, 0, 1])  # shares 3/4 and 1/4 of 2 options present (K = 3)
    # w_0 = 1 / (2 * 3/4) = 2/3 ; w_1 = 1 / (2 * 1/4) = 2 ; mean over samples (3 * 2/3 + 2) / 4 = 1
    w = losses.option_loss_weights(option, K=3)
    torch.testing.assert_close(w, torch.tensor([2 / 3, 2 / 3, 2 / 3, 2.0]))
    assert float(w[option == 0].sum()) == pytest.approx(float(w[option == 1].sum()))  # equal total weight
    capped = losses.option_loss_weights(torch.tensor([0] * 99 + [1]), K=2, max_weight=10.0)
    # raw weights 1/(2 * .99) ~ .505 and 50 -> capped to 10, then renormalised to mean 1
    raw = torch.tensor([1 / 1.98] * 99 + [10.0])
    torch.testing.assert_close(capped, raw / raw.mean())
