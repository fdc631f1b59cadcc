"""chimes.metrics.observe_many: a batch of observations lands where observing them one by one would."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from chimes.metrics import LAG_BUCKETS, observe_many

# On the bounds, just past them, zero, past the last bound, and repeated values.
AMOUNTS = [0.0, 0.01, 0.0100001, 0.05, 0.05, 0.3, 1.0, 2.0, 4.999, 5.0, 299.0, 300.0, 301.0, 1e9, 0.2, 0.2, 0.2]


def _histograms(labels: tuple[str, ...] = ()) -> tuple[CollectorRegistry, Histogram, CollectorRegistry, Histogram]:
    one, many = CollectorRegistry(), CollectorRegistry()
    return (one, Histogram("lag_seconds", "lag", labels, buckets=LAG_BUCKETS, registry=one),
            many, Histogram("lag_seconds", "lag", labels, buckets=LAG_BUCKETS, registry=many))


def _exposition(registry: CollectorRegistry) -> list[str]:
    # the _created sample is the moment each histogram was made: not an observation
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def test_a_batch_is_counted_in_the_same_buckets_and_sum_as_one_observe_each() -> None:
    one_registry, one_by_one, many_registry, batched = _histograms()
    for amount in AMOUNTS:
        one_by_one.observe(amount)
    observe_many(batched, AMOUNTS)
    assert _exposition(many_registry) == _exposition(one_registry)
    assert 'lag_seconds_bucket{le="0.01"} 2.0' in _exposition(many_registry)  # 0.0 and 0.01: le is <=
    assert f"lag_seconds_count {float(len(AMOUNTS))}" in _exposition(many_registry)


def test_a_labelled_child_is_batched_and_an_empty_batch_changes_nothing() -> None:
    one_registry, one_by_one, many_registry, batched = _histograms(("status",))
    for amount in AMOUNTS[:5]:
        one_by_one.labels("ok").observe(amount)
    observe_many(batched.labels("ok"), AMOUNTS[:5])
    observe_many(batched.labels("ok"), [])
    assert _exposition(many_registry) == _exposition(one_registry)


def test_a_nan_goes_into_the_sum_and_no_bucket_as_observe_has_it() -> None:
    one_registry, one_by_one, many_registry, batched = _histograms()
    for amount in (1.0, math.nan):
        one_by_one.observe(amount)
    observe_many(batched, [1.0, math.nan])
    assert _exposition(many_registry) == _exposition(one_registry)


def test_a_histogram_with_labels_but_no_child_is_refused_as_observe_refuses_it() -> None:
    _, _, _, batched = _histograms(("status",))
    with pytest.raises(ValueError, match="label"):
        observe_many(batched, [1.0])
