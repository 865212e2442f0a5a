"""Timeline: timestamped spans of every stage on every worker of a run.

Every process of a run (driver, trainer actors, vLLM engines, reward actors) appends
what it did to `<OPPO_TIMELINE_DIR>/<pid>.jsonl`, one JSON object a line, written
when the span ends (so a killed run keeps everything that finished):

    {"kind": "span", "role": "actor", "pid": 123, "stage": "train", "t0": ..., "t1": ...}
    {"kind": "sample", "role": "rollout", "pid": 456, "t0": ..., "t1": ..., "tokens": 57,
     "finish": "stop", "sample": 12}            # one decoded response (sample id: OPPO only)

Spans of one worker (role, pid) never overlap: a worker does one stage at a time.
Samples overlap freely (an engine decodes many at once). Times are `time.time()`
seconds. With the variable unset nothing is written and a span costs one `if`.

Stdlib only: imported by the compat site hook in every process of a run.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Iterator

TIMELINE_ENV = "OPPO_TIMELINE_DIR"


class Recorder:
    """Appends this process's spans to `<directory>/<pid>.jsonl` (no-op without a directory)."""

    def __init__(self, directory: str | None):
        self.directory = Path(directory) if directory else None
        self._lock = threading.Lock()  # Ray runs sync actor methods on a thread pool
        self._fh = None  # opened at the first record, after a fork has settled the pid
        self._pid = 0

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def _write(self, row: dict) -> None:
        line = json.dumps(row, separators=(",", ":")) + "\n"
        with self._lock:
            pid = os.getpid()
            if self._fh is None or self._pid != pid:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._fh, self._pid = open(self.directory / f"{pid}.jsonl", "a", buffering=1), pid
            self._fh.write(line)

    def span(self, role: str, stage: str, t0: float, t1: float, **attrs) -> None:
        if self.enabled:
            self._write({"kind": "span", "role": role, "pid": os.getpid(), "stage": stage, "t0": t0, "t1": t1, **attrs})

    def sample(self, role: str, t0: float, t1: float, tokens: int, finish: str | None, **attrs) -> None:
        if self.enabled:
            self._write({"kind": "sample", "role": role, "pid": os.getpid(), "t0": t0, "t1": t1,
                         "tokens": tokens, "finish": finish, **attrs})

    @contextlib.contextmanager
    def timed(self, role: str, stage: str, **attrs) -> Iterator[None]:
        t0 = time.time()
        try:
            yield
        finally:
            self.span(role, stage, t0, time.time(), **attrs)


RECORDER = Recorder(os.environ.get(TIMELINE_ENV))  # this process's recorder


def read(directory: Path | str) -> list[dict]:
    """Every record under `directory`, sorted by start time. A line cut by a kill is skipped."""
    rows = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return sorted(rows, key=lambda r: (r["t0"], r["t1"]))


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of intervals as sorted, disjoint intervals."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def covered_s(intervals: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Seconds of [t0, t1] covered by the union of `intervals`."""
    return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in merge(intervals))


def busy_intervals(rows: list[dict], role: str) -> list[tuple[float, float]]:
    """When `role` was working: its spans, and for rollout engines the decoding of any sample."""
    keep = ("span", "sample") if role == "rollout" else ("span",)
    return [(r["t0"], r["t1"]) for r in rows if r["role"] == role and r["kind"] in keep]


def idle_fractions(rows: list[dict], t0: float, t1: float) -> dict[str, float]:
    """role -> share of [t0, t1] in which none of that role's workers was busy."""
    window = max(t1 - t0, 1e-9)
    roles = sorted({r["role"] for r in rows})
    return {role: 1.0 - covered_s(busy_intervals(rows, role), t0, t1) / window for role in roles}
