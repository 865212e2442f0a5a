"""The prompt-group ledger: event logs written the way the OpenRLHF driver writes them,
from the real scheduler, with crashes at seeded random points and restarts from the
last checkpoint; and hand-made logs with each kind of fault the check must catch."""

from __future__ import annotations

import json
import random

import pytest

from openrlhf_oppo.cli.main import main
from openrlhf_oppo.config import DeltaConfig
from openrlhf_oppo.core import StepStats, ledger


def _prompt(position: int) -> str:
    return f"{position % 5:04x}"  # a 5-prompt dataset read pass after pass


class Run:
    """A driver writing ledger events as `OppoSamplesGenerator` does; `crash_at` kills it
    after that many events of the step loop, `save_every` checkpoints after those steps."""

    def __init__(self, path, rng, make_scheduler, save_every=2):
        self.make_scheduler = make_scheduler
        self.path, self.rng, self.save_every = path, rng, save_every
        self.checkpoint = None  # (state, step)

    def attempt(self, total_steps: int, crash_after_steps: int | None) -> bool:
        sched = self.make_scheduler(2, 2, ("reward",), delta=DeltaConfig(init=2, max=2, adaptive=False), chunk=2)
        if self.checkpoint:
            sched.load_state_dict(json.loads(self.checkpoint))
        step = sched.state_dict()["last_step"] + 1
        ledger.append_event(self.path, {"event": "start", "last_step": step - 1, "held": list(sched.in_flight_groups),
                                        "next_group_id": sched.next_prompt_index, "per_pass": 5})
        done = 0
        while step < total_steps:
            if crash_after_steps is not None and done == crash_after_steps:
                return False  # killed between steps
            plan = sched.begin_step(step)
            sched.on_scored_many("reward", plan.restream)
            admitted = [[g.group_id, g.prompt_index, _prompt(g.prompt_index)] for g in plan.admit]
            held = [sid for gid in sched.in_flight_groups for sid in sched.group_sample_ids(gid)]
            live = [sid for sid in held if not sched.is_finished(sid)]
            self.rng.shuffle(live)
            batch = None
            while batch is None:
                sid = live.pop()
                chunks = sched.on_tokens(sid, [1] * self.rng.randint(0, 5), None, step)
                sched.on_scored_many("reward", chunks + sched.on_finished(sid))
                batch = sched.take_batch()
            if crash_after_steps is not None and done == crash_after_steps - 1 and self.rng.random() < 0.5:
                return False  # killed inside the step: its event is never written
            report = sched.end_step(StepStats(0.0, 1, 1.0))
            ledger.append_event(self.path, {"event": "step", "step": step, "admitted": admitted,
                                            "trained": [[g.group_id, g.deferrals] for g in batch.groups],
                                            "held": list(report.carried_groups)})
            if step % self.save_every == self.save_every - 1:
                self.checkpoint = json.dumps(sched.state_dict())
                ledger.append_event(self.path, {"event": "checkpoint", "step": step})
            step += 1
            done += 1
        return True


@pytest.mark.parametrize("seed", range(8))
def test_crashes_at_random_points_and_resumes_keep_the_ledger(tmp_path, seed, make_scheduler):
    rng = random.Random(seed)
    path = tmp_path / ledger.LEDGER_FILE
    run = Run(path, rng, make_scheduler)
    crashes = 0
    while not run.attempt(total_steps=12, crash_after_steps=rng.randint(1, 5) if crashes < 3 else None):
        crashes += 1
    report = ledger.check_run(tmp_path)
    assert report.ok, report.summary()
    assert report.restarts == crashes and report.last_step == 11
    assert report.trained == 24 and report.held + report.trained == report.admitted
    assert main(["ledger", "check", str(tmp_path)]) == 0


def _log(tmp_path, events):
    path = tmp_path / ledger.LEDGER_FILE
    for ev in events:
        ledger.append_event(path, ev)
    return path


START = {"event": "start", "last_step": -1, "held": [], "next_group_id": 0}


def _step(step, admitted, trained, held):
    return {"event": "step", "step": step, "admitted": [[g, g, f"p{g}"] for g in admitted],
            "trained": [[g, 0] for g in trained], "held": held}


@pytest.mark.parametrize(
    "events, problem",
    [
        ([START, _step(0, [0, 1], [0], [1]), _step(1, [2], [1, 0], [2])], "group 0 was trained twice"),
        ([START, _step(0, [0, 1, 2], [0], [1])], "neither trained nor held: [2]"),
        ([START, _step(0, [0, 1], [0], [1]), {**START, "last_step": 0, "held": [5]}], "the log held [1]"),
        ([START, _step(0, [0, 2], [0, 2], [])], "admitted out of order or twice"),
        ([START, _step(0, [0, 1], [0], [1]), {**START, "last_step": 3, "held": [1]}], "no step 3 to resume from"),
        ([START, _step(0, [0, 1], [0], [1]), _step(1, [2], [2], [1]), {**START, "last_step": 0, "held": [1]},
          {**_step(1, [2], [2], [1]), "admitted": [[2, 2, "other"]]}], "prompt position 2 was a different prompt"),
    ],
)
def test_the_check_names_each_fault(tmp_path, events, problem):
    report = ledger.check_run(_log(tmp_path, events))
    assert not report.ok and any(problem in p for p in report.problems), report.problems
    assert main(["ledger", "check", str(tmp_path)]) == 1


def test_a_rollback_leaves_the_lineage_and_a_cut_last_line_is_ignored(tmp_path, capsys):
    path = _log(tmp_path, [START, _step(0, [0, 1], [0], [1]), {"event": "checkpoint", "step": 0},
                           _step(1, [2], [1], [2]),  # rolled back: the restart resumes after step 0
                           {**START, "last_step": 0, "held": [1]}, _step(1, [2], [2, 1], [])])
    with open(path, "a") as fh:
        fh.write('{"event": "step", "st')  # killed while writing
    report = ledger.check_run(tmp_path)
    assert report.ok, report.problems
    assert (report.restarts, report.rolled_back_steps, report.trained, report.checkpoints) == (1, 1, 3, [0])
    assert main(["ledger", "check", str(tmp_path), str(tmp_path / "missing")]) == 2
    assert "no ledger" in capsys.readouterr().out
