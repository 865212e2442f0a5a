"""The prompt-group ledger: proof that every admitted group was trained exactly once
or is still held, across crashes and restarts.

Two records, both checked here (stdlib only):

* the scheduler's checkpoint (`checkpoint.dump`): held groups plus one ledger row
  per trained group; `check_state` verifies they account for every group id the
  checkpoint ever admitted, each once;
* a run's event log, ``RUN_DIR/ledger.jsonl``, appended by the OpenRLHF driver:

  - ``{"event": "start", "last_step": k, "held": [...], "next_group_id": N}`` when a
    run (re)starts: from a checkpoint after step k, or fresh (k = -1). The steps of
    earlier attempts after k were rolled back with the weights: they leave the lineage.
  - ``{"event": "step", "step": s, "admitted": [[gid, prompt_index, prompt_hash], ...],
    "trained": [[gid, deferrals], ...], "held": [...]}`` when a step ends.
  - ``{"event": "checkpoint", "step": s}`` when OPPO's state was saved with a checkpoint.

  `check_events` replays the lineage: the held groups at each restart must be those the
  log held after that step, group ids are admitted in order without gaps, and at the end
  every admitted group is trained exactly once or held. A prompt position admitted again
  after a rollback must be the same prompt (the data order was restored).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LEDGER_FILE = "ledger.jsonl"
# a checkpoint's ledger row per trained group (flat in the checkpoint)
LEDGER_FIELDS = ("group_id", "prompt_index", "admitted_step", "trained_step", "deferrals")


@dataclass
class LedgerReport:
    admitted: int = 0
    trained: int = 0
    held: int = 0
    restarts: int = 0
    rolled_back_steps: int = 0
    last_step: int = -1
    checkpoints: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        verdict = "OK: every admitted group was trained exactly once or is held" if self.ok else "FAILED"
        lines = [
            f"{verdict}",
            f"  groups admitted {self.admitted}, trained {self.trained}, held {self.held}",
            f"  steps {self.last_step + 1}, restarts {self.restarts}, steps rolled back {self.rolled_back_steps}, "
            f"checkpoints at steps {self.checkpoints or 'none'}",
        ]
        return "\n".join(lines + [f"  - {p}" for p in self.problems[:50]])


def append_event(path: str | Path, event: dict[str, Any]) -> None:
    """One event per line, written and flushed whole (a kill cuts at most the last line)."""
    with open(path, "a") as fh:
        fh.write(json.dumps(event) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def check_state(state: dict[str, Any]) -> list[str]:
    """Problems of a scheduler checkpoint's ledger (empty: it accounts for every group once)."""
    if state.get("version", 0) < 2:
        return []  # no ledger before version 2
    rows = state["ledger"]
    trained = rows[0 :: len(LEDGER_FIELDS)]
    held = [g["group_id"] for g in state["groups"]]
    return _account(trained, held, state["next_group_id"])


def _account(trained: list[int], held: list[int], admitted: int) -> list[str]:
    problems = []
    seen: set[int] = set()
    for gid in trained:
        if gid in seen:
            problems.append(f"group {gid} was trained twice")
        seen.add(gid)
    for gid in set(held) & seen:
        problems.append(f"group {gid} is held but was trained already")
    lost = set(range(admitted)) - seen - set(held)
    if lost:
        problems.append(f"{len(lost)} admitted group(s) neither trained nor held: {sorted(lost)[:20]}")
    unknown = (seen | set(held)) - set(range(admitted))
    if unknown:
        problems.append(f"group(s) {sorted(unknown)[:20]} trained or held but never admitted")
    return problems


def read_events(path: Path) -> list[dict[str, Any]]:
    lines = Path(path).read_text().splitlines()
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if n == len(lines):
                continue  # a last line cut short by a kill: the step it describes did not complete
            raise ValueError(f"{path}:{n}: not JSON: {line[:80]!r}") from None
    return rows


def check_events(events: Iterable[dict[str, Any]]) -> LedgerReport:
    report = LedgerReport()
    lineage: list[dict[str, Any]] = []  # step events of the surviving history
    prompt_at: dict[int, str] = {}  # prompt position -> prompt hash, over every attempt
    started = False
    for ev in events:
        kind = ev.get("event")
        if kind == "start":
            k = ev["last_step"]
            kept = [row for row in lineage if row["step"] <= k]
            report.rolled_back_steps += len(lineage) - len(kept)
            if started:
                report.restarts += 1
            started = True
            lineage = kept
            if k >= 0:
                logged = lineage[-1]["held"] if lineage and lineage[-1]["step"] == k else None
                if logged is None:
                    report.problems.append(f"restart from step {k}, but the log has no step {k} to resume from")
                elif sorted(logged) != sorted(ev["held"]):
                    report.problems.append(
                        f"restart from step {k} holds groups {sorted(ev['held'])}, the log held {sorted(logged)}"
                    )
        elif kind == "step":
            if not started:
                report.problems.append(f"step {ev['step']} logged before any start event")
                started = True
            expected = lineage[-1]["step"] + 1 if lineage else None
            if expected is not None and ev["step"] != expected:
                report.problems.append(f"step {ev['step']} follows step {expected - 1}")
            lineage.append(ev)
            for gid, position, digest in ev["admitted"]:
                if prompt_at.setdefault(position, digest) != digest:
                    report.problems.append(f"prompt position {position} was a different prompt when admitted again "
                                           f"after a restart (group {gid}): the data order was not restored")
        elif kind == "checkpoint":
            report.checkpoints.append(ev["step"])
    admitted = [a[0] for row in lineage for a in row["admitted"]]
    if admitted != list(range(len(admitted))):
        report.problems.append(f"group ids admitted out of order or twice: {admitted[:40]}")
    trained = [t[0] for row in lineage for t in row["trained"]]
    held = lineage[-1]["held"] if lineage else []
    report.problems += _account(trained, held, len(admitted))
    report.admitted = len(admitted)
    report.trained = len(trained)
    report.held = len(held)
    report.last_step = lineage[-1]["step"] if lineage else -1
    return report


def check_run(run_dir: Path) -> LedgerReport:
    """Check ``RUN_DIR/ledger.jsonl`` (or a ledger file given directly)."""
    path = Path(run_dir)
    path = path / LEDGER_FILE if path.is_dir() else path
    if not path.exists():
        raise FileNotFoundError(f"{path}: no ledger (OPPO schedules write RUN_DIR/{LEDGER_FILE})")
    return check_events(read_events(path))
