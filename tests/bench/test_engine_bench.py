"""`openrlhf-oppo bench engine`: a vLLM decode iteration's cost by sequences decoded together."""

from __future__ import annotations

import pytest

from openrlhf_oppo.bench import engine as bench


@pytest.mark.e2e  # a real vLLM engine (CPU build) on the tiny task's actor
def test_prints_a_row_per_sequence_count_with_the_cost_of_an_iteration_and_a_token(capsys):
    assert bench.main(["--variant", "tiny", "--tokens", "16", "--sequences", "1,8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = [i for i, line in enumerate(lines) if line.startswith("engine: tiny's actor, 16 tokens a sequence")]
    assert len(head) == 1
    rows = [line.split() for line in lines[head[0] + 2:]]
    assert [r[0] for r in rows] == ["1", "8"]
    for r in rows:
        wall, core, front, per_token = map(float, r[1:])
        assert wall > 0 and core > 0 and front >= 0
        assert per_token == pytest.approx((core + front) / int(r[0]), rel=0.01, abs=0.002)


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "4"], "--tokens: 4; allowed: an integer >= 8"),
    (["--sequences", "4,0"], "'4,0'; allowed: a comma-separated list of integers >= 1"),
])
def test_bad_values_are_refused_by_name(capsys, argv, message):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err
