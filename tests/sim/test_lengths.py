"""Response-length samplers: a replayed list is drawn in order, whatever the seed."""

from __future__ import annotations

import json
import random

from openrlhf_oppo.sim.lengths import LengthSampler
from openrlhf_oppo.sim.presets import load_preset


def test_replay_draws_the_list_in_order_and_wraps(tmp_path):
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps([5, 2000, 7]))
    cfg = load_preset("cpu-longtail", ["lengths.kind=replay", f"lengths.path={path}", "lengths.cap_tokens=1024"])
    for seed in (0, 1):
        sampler = LengthSampler(cfg.lengths, random.Random(seed))
        assert [sampler.sample() for _ in range(5)] == [5, 1024, 7, 5, 1024]  # 2000 capped
