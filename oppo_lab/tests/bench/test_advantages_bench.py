"""`python -m oppo_lab advantages`: OpenRLHF's loop and OPPO's version timed per micro-batch shape."""

from __future__ import annotations

import pytest

from oppo_lab import advantages_bench as bench
from oppo_lab.__main__ import main as lab_main


@pytest.mark.parametrize("estimator", ["gae", "reinforce"])
def test_prints_a_row_per_shape_with_both_timings_and_their_ratio(capsys, monkeypatch, estimator):
    monkeypatch.setattr(bench, "SHAPES", ((2, 64), (1, 300)))
    assert lab_main(["advantages", "--repeats", "1", "--estimator", estimator]) == 0
    lines = capsys.readouterr().out.splitlines()  # DeepSpeed's first import may print a line before
    head = [i for i, line in enumerate(lines) if line.startswith(f"{estimator}: OpenRLHF 0.11.2's loop against")]
    assert len(head) == 1
    rows = [line.split() for line in lines[head[0] + 2:]]
    assert [r[:3] for r in rows] == [["2", "x", "64"], ["1", "x", "300"]]
    for r in rows:
        loop_ms, loop_us, ours_ms, ours_us = map(float, r[3:7])
        assert loop_ms > 0 and ours_ms > 0 and r[7].endswith("x")
        assert float(r[7][:-1]) == pytest.approx(loop_ms / ours_ms, rel=0.1, abs=0.1)


def test_repeats_below_one_are_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--repeats", "0"])
    assert "--repeats: 0; allowed: an integer >= 1" in capsys.readouterr().err
