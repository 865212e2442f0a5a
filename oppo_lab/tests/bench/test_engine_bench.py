"""`python -m oppo_lab engine`: a vLLM decode iteration's cost by sequences decoded together."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from oppo_lab import engine_bench as bench


@pytest.mark.e2e  # a real vLLM engine (CPU build) on the tiny task's actor, in a process of its own
def test_prints_a_row_per_sequence_count_with_the_cost_of_an_iteration_and_a_token():
    out = subprocess.run([sys.executable, "-m", "oppo_lab", "engine", "--variant", "tiny",
                          "--tokens", "16", "--sequences", "1,8"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    head = [i for i, line in enumerate(lines) if line.startswith("engine: tiny's actor, 16 tokens a sequence")]
    assert len(head) == 1, out.stdout
    rows = [line.split() for line in lines[head[0] + 2:head[0] + 4]]  # vLLM's own log lines may follow
    assert [r[0] for r in rows] == ["1", "8"]
    for r in rows:
        wall, core, front, per_token = map(float, r[1:])
        assert wall > 0 and core > 0 and front >= 0
        assert per_token == pytest.approx((core + front) / int(r[0]), rel=0.01, abs=0.002)


def test_the_compat_layers_variables_do_not_outlive_the_bench(monkeypatch):
    """They are for the engine's processes: a caller's later subprocesses (the rest of a test session) must
    not start with the CPU compat layer installed."""
    before = dict(os.environ)
    seen = {}
    monkeypatch.setattr(bench, "_measure", lambda args, actor: seen.update(os.environ))
    assert bench.main(["--variant", "tiny"]) == 0
    assert seen.get("OPPO_COMPAT") == "1" and dict(os.environ) == before


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "4"], "--tokens: 4; allowed: an integer >= 8"),
    (["--sequences", "4,0"], "'4,0'; allowed: a comma-separated list of integers >= 1"),
])
def test_bad_values_are_refused_by_name(capsys, argv, message):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err
