"""Shipping a learn build (oppo_lab.learn.ship), and (slow) a rebuild from scratch lands within
the stated tolerances of the shipped summary."""

from __future__ import annotations

import json

import pytest

from openrlhf_oppo.tasks import learn
from openrlhf_oppo.tasks.learn import shipped
from oppo_lab.learn import builder, ship


def test_ship_refuses_an_unfinished_build(tmp_path):
    with pytest.raises(ValueError, match="not a finished build of learn-longtail"):
        ship.ship("learn-longtail", tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["learn-longtail"])
def test_a_rebuild_matches_the_shipped_summary(tmp_path, variant):
    """`build-learn --force`: a build from scratch (~10 min on 2 cores) lands within TOLERANCES
    of the shipped summary."""
    spec = learn.VARIANTS[variant]
    rebuilt = json.loads(builder.build(tmp_path / variant, spec, force=True).summary.read_text())
    shipped_summary = json.loads(shipped.shipped(spec).summary.read_text())

    def get(summary, key):
        for part in key.split("."):
            summary = summary[part]
        return summary

    for key, tolerance in ship.TOLERANCES.items():
        a = get(rebuilt, key)
        b = get(shipped_summary, key)
        allowed = tolerance * b if key == "rm_train_pairs" else tolerance
        assert abs(a - b) <= allowed, f"{key}: rebuilt {a}, shipped {b}, tolerance {allowed}"
