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
        Path(argv[argv.index("--output") + 1]).mkdir(parents=True, exist_ok=True)  # the bench made it (cpu.jsonl)
        return Result(130, 4.0, signal.SIGINT)

    monkeypatch.setattr(train, "run", run)
    code = schedules.main(["--config", "configs/tiny-cpu.yaml", "--schedules", "sync", "oppo", "--repeats", "2",
                           "--output", str(tmp_path)])
    assert code == 130 and len(calls) == 1
    assert "[bench schedules] stopped by SIGINT in run 1/4: no further runs" in capsys.readouterr().out


def test_a_run_that_was_not_signalled_does_not_stop_the_bench():
    assert schedules.stopped("schedules", Result(1, 4.0), 1, 4) is None


def test_keep_done_runs_only_what_did_not_finish(tmp_path, monkeypatch, capsys):
    """A bench cut short goes on with `--keep-done`: finished runs are read, not run again."""
    import json

    from openrlhf_oppo.integrations.launch import train_run as train

    for name, code in (("sync-0", 0), ("oppo-0", 1)):  # a finished run and a failed one
        (tmp_path / name).mkdir()
        (tmp_path / name / "result.json").write_text(json.dumps({"returncode": code, "wall_s": 9.0}))
    calls = []

    def run(argv):
        root = Path(argv[argv.index("--output") + 1])
        calls.append(root.name)
        root.mkdir(parents=True, exist_ok=True)
        return Result(1, 4.0)  # failed: summarize nothing

    monkeypatch.setattr(train, "run", run)
    monkeypatch.setattr(schedules, "summarize_run", lambda root, warmup: {"steps": 0, "step_s": []})
    schedules.main(["--config", "configs/tiny-cpu.yaml", "--schedules", "sync", "oppo", "--repeats", "2",
                    "--keep-done", "--output", str(tmp_path)])
    assert calls == ["oppo-0", "sync-1", "oppo-1"]
    assert "run 1/4: sync: kept" in capsys.readouterr().out
