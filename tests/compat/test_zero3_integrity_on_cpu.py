"""ZeRO-3 loads on 2 gloo ranks return the checkpoint's weights bit for bit
(DeepSpeed 0.19.6 all-gather race on gloo). With the fix turned
off (`python -m openrlhf_oppo.compat.zero3_check DIR --unfixed`) 4 of 8 loads came
back corrupt in one of two tries on the development machine; with it, 0 of 24."""

from __future__ import annotations

import pytest

from openrlhf_oppo.compat import zero3_check

pytestmark = pytest.mark.e2e  # real DeepSpeed processes (2 gloo ranks)


def test_zero3_load_on_two_ranks_keeps_every_weight_intact_on_cpu(tmp_path):
    from openrlhf_oppo.tasks import tiny

    assets = tiny.build(tmp_path / "tiny")
    assert zero3_check.check(str(assets.actor), world_size=2, loads=8) == []
