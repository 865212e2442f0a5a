"""`--oppo.staleness.correction` -> OpenRLHF's importance-sampling flags, 'auto' included."""

from __future__ import annotations

import pytest

from openrlhf_oppo.config import AUTO_CORRECTION, DeltaConfig, OppoConfig, StalenessConfig, StreamingConfig
from openrlhf_oppo.integrations.launch.driver import CORRECTIONS, openrlhf_argv


def _cfg(correction: str = "auto", lag: int = 0) -> OppoConfig:
    return OppoConfig(staleness=StalenessConfig(correction=correction, max_policy_lag=lag),
                      delta=DeltaConfig(enable=lag != 1), streaming=StreamingConfig(enable=False))


@pytest.mark.parametrize("correction, lag, added", [
    ("auto", 0, []),  # no async admission: nothing to correct beyond what OPPO always did
    ("auto", 2, CORRECTIONS[AUTO_CORRECTION]),
    ("auto", 1, CORRECTIONS[AUTO_CORRECTION]),
    ("none", 2, []),
    ("icepop", 0, CORRECTIONS["icepop"]),
])
def test_the_correction_each_setting_adds(correction, lag, added):
    assert openrlhf_argv(["--actor.x", "1"], _cfg(correction, lag)) == ["--actor.x", "1", *added]


def test_auto_leaves_the_users_own_openrlhf_correction_alone_an_explicit_one_is_refused():
    own = ["--algo.advantage.is_correction_level", "sequence"]
    assert openrlhf_argv(own, _cfg("auto", 2)) == own
    for opt_out in (["--algo.advantage.is_correction_level", "off"], ["--algo.advantage.is_correction_mode=mask"]):
        assert openrlhf_argv(opt_out, _cfg("auto", 2)) == opt_out  # any of its flags: the user's choice
    # argparse keeps the last occurrence: a preset's `token` overridden by the user's `off` is off
    overridden = ["--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_level", "off"]
    assert openrlhf_argv(overridden, _cfg("tis", 2))[-4:] == CORRECTIONS["tis"]
    with pytest.raises(ValueError, match="cannot be combined with --algo.advantage.is_correction_level"):
        openrlhf_argv(own, _cfg("tis", 2))
