"""`python -m oppo_lab convergence`'s command line with no run behind it: bad arguments refused
before any run, the bench's schedule variants, --help."""

from __future__ import annotations

import pytest

from oppo_lab import convergence


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--schedules", "sync", "nope"], "--schedules: unknown nope"),
        (["--seeds", "0"], "--seeds must be >= 1"),
        (["--window", "0"], "--window must be >= 1"),
        (["--", "--train.seed", "3"], "--train.seed after `--`"),
    ],
)
def test_bad_arguments_are_refused_before_any_run(argv, message, capsys, monkeypatch):
    from openrlhf_oppo.integrations.launch import train_run as train

    monkeypatch.setattr(train, "run", lambda argv: pytest.fail("ran"))
    with pytest.raises(SystemExit) as exit_:
        convergence.main(["--report-only", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_bench_variants_are_schedules_with_one_flag():
    assert convergence.resolve("oppo-tis") == convergence.Variant("oppo", ("--oppo.staleness.correction", "tis"))
    assert convergence.resolve("oppo-icepop") == convergence.Variant("oppo", ("--oppo.staleness.correction", "icepop"))
    assert convergence.resolve("oppo-none") == convergence.Variant("oppo", ("--oppo.staleness.correction", "none"))
    defer1 = convergence.Variant("oppo", ("--oppo.staleness.max_deferral_steps", "1"))
    assert convergence.resolve("oppo-defer1") == defer1
    assert convergence.resolve("partial") == convergence.Variant("partial")


def test_help_prints_and_exits_zero(capsys):
    with pytest.raises(SystemExit) as exit_:
        convergence.main(["--help"])
    assert exit_.value.code == 0 and "--threshold" in capsys.readouterr().out
