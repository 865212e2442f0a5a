"""A signal that stops a bench's current run (Ctrl-C, SIGTERM: the launcher ends the run
gracefully and returns) stops the whole bench: no further run starts."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

from openrlhf_oppo.bench import schedules


@dataclass
class Result:
    returncode: int
    wall_s: float
    stopped_by: int | None = None


def test_bench_schedules_stops_with_its_run(tmp_path, monkeypatch, capsys):
    from openrlhf_oppo.integrations.launch import train_run as train

    calls = []

    def run(argv):
        calls.append(argv)
        Path(argv[argv.index("--output") + 1]).mkdir(parents=True)
        return Result(130, 4.0, signal.SIGINT)

    monkeypatch.setattr(train, "run", run)
    code = schedules.main(["--config", "configs/tiny-cpu.yaml", "--schedules", "sync", "oppo", "--repeats", "2",
                           "--output", str(tmp_path)])
    assert code == 130 and len(calls) == 1
    assert "[bench schedules] stopped by SIGINT in run 1/4: no further runs" in capsys.readouterr().out


def test_a_run_that_was_not_signalled_does_not_stop_the_bench():
    assert schedules.stopped("schedules", Result(1, 4.0), 1, 4) is None
