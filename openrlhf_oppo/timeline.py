"""Timeline: timestamped spans of every stage on every worker of a run.

Every process of a run (driver, trainer actors, vLLM engines, reward actors) appends
what it did to `<OPPO_TIMELINE_DIR>/<host>-<pid>.jsonl`, one JSON object a line,
written when the span ends (so a killed run keeps everything that finished):

    {"kind": "span", "role": "actor", "host": "n0", "pid": 123, "stage": "train", "t0": ..., "t1": ...}
    {"kind": "open", "role": "rollout", ..., "key": 7, "t0": ..., "t1": ...}   # a response started
    {"kind": "sample", "role": "rollout", ..., "key": 7, "t0": ..., "t1": ..., "tokens": 57,
     "finish": "stop", "sample": 12}   # that response finished (sample id: OPPO only)

Spans of one worker (role, host, pid) never overlap: a worker does one stage at a
time. Samples overlap freely (an engine decodes many at once); an `open` record without
its `sample` is a response still decoding. Times are `time.time()` seconds (on a
cluster, each node's clock). With the variable unset nothing is written and a span
costs one `if`.

Stdlib only: imported by the site hook in every process of a run.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from openrlhf_oppo import run_env


class Recorder:
    """Appends this process's spans to `<directory>/<host>-<pid>.jsonl` (no-op without a directory)."""

    def __init__(self, directory: str | None):
        self.directory = Path(directory) if directory else None
        self.host = socket.gethostname()
        self._lock = threading.Lock()  # Ray runs sync actor methods on a thread pool
        self._fh = None  # opened at the first record, after a fork has settled the pid
        self._pid = 0
        self._keys = itertools.count()  # pairs a response's `open` and `sample` records

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def _write(self, kind: str, role: str, t0: float, t1: float, attrs: dict) -> None:
        pid = os.getpid()
        row = {"kind": kind, "role": role, "host": self.host, "pid": pid, "t0": t0, "t1": t1, **attrs}
        line = json.dumps(row, separators=(",", ":")) + "\n"
        with self._lock:
            if self._fh is None or self._pid != pid:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._fh = open(self.directory / f"{self.host}-{pid}.jsonl", "a", buffering=1)
                self._pid = pid  # a forked child opens a file of its own
            self._fh.write(line)

    def span(self, role: str, stage: str, t0: float, t1: float, **attrs) -> None:
        if self.enabled:
            self._write("span", role, t0, t1, {"stage": stage, **attrs})

    def open_sample(self, role: str) -> tuple[int, float]:
        """A response starts decoding: (key, start time) to pass to `sample` when it ends."""
        key = next(self._keys)
        t0 = time.time()
        if self.enabled:
            self._write("open", role, t0, t0, {"key": key})
        return key, t0

    def sample(self, role: str, opened: tuple[int, float], tokens: int, finish: str | None, **attrs) -> None:
        key, t0 = opened
        if self.enabled:
            self._write("sample", role, t0, time.time(), {"key": key, "tokens": tokens, "finish": finish, **attrs})

    @contextlib.contextmanager
    def timed(self, role: str, stage: str, **attrs) -> Iterator[None]:
        t0 = time.time()
        try:
            yield
        finally:
            self.span(role, stage, t0, time.time(), **attrs)


RECORDER = Recorder(run_env.path(run_env.TIMELINE_DIR))  # this process's recorder


def _parse(lines: list[str]) -> list[dict]:
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill
            continue
    return rows


def read(directory: Path | str) -> list[dict]:
    """Every record under `directory`, sorted by start time."""
    rows = [r for path in sorted(Path(directory).glob("*.jsonl")) for r in _parse(path.read_text().splitlines())]
    return sorted(rows, key=lambda r: (r["t0"], r["t1"]))


class Tail:
    """Reads a run's timeline as it grows: each call parses only what was appended
    since the last one and keeps the records that may still matter (ending after
    `keep_after_s`, and responses still decoding)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.offsets: dict[Path, int] = {}
        self.rows: list[dict] = []

    def read(self, keep_after_s: float) -> list[dict]:
        for path in sorted(self.directory.glob("*.jsonl")):
            with open(path, "rb") as fh:
                fh.seek(self.offsets.get(path, 0))
                data = fh.read()
            complete = data[: data.rfind(b"\n") + 1]  # a line being written is read next time
            self.offsets[path] = self.offsets.get(path, 0) + len(complete)
            self.rows += _parse(complete.decode().splitlines())
        ended = {(r["host"], r["pid"], r["key"]) for r in self.rows if r["kind"] == "sample"}
        self.rows = [r for r in self.rows if r["t1"] >= keep_after_s
                     or (r["kind"] == "open" and (r["host"], r["pid"], r["key"]) not in ended)]
        return self.rows


def worker(row: dict) -> tuple[str, str, int]:
    return row["role"], row.get("host", ""), row["pid"]


def stage_spans(rows: list[dict], role: str, stage: str) -> list[dict]:
    return [r for r in rows if r["kind"] == "span" and r["role"] == role and r["stage"] == stage]


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of intervals as sorted, disjoint intervals."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def subtract(intervals: list[tuple[float, float]], minus: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of `intervals` less the union of `minus`, as sorted, disjoint intervals."""
    out = []
    cuts = merge(minus)
    for a, b in merge(intervals):
        for c, d in cuts:
            if c < b and d > a:
                if c > a:
                    out.append((a, c))
                a = max(a, d)
        if a < b:
            out.append((a, b))
    return out


def covered_s(intervals: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Seconds of [t0, t1] covered by the union of `intervals`."""
    return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in merge(intervals))


def busy_intervals(rows: list[dict], role: str, now_s: float) -> list[tuple[float, float]]:
    """When `role` was working: its spans, and for rollout engines the decoding of any
    response (one still decoding counts until `now_s`)."""
    out = [(r["t0"], r["t1"]) for r in rows if r["role"] == role and r["kind"] in ("span", "sample")]
    if role == "rollout":
        ended = {(r.get("host"), r["pid"], r["key"]) for r in rows if r["kind"] == "sample" and "key" in r}
        out += [(r["t0"], now_s) for r in rows if r["role"] == role and r["kind"] == "open"
                and (r.get("host"), r["pid"], r["key"]) not in ended]
    return out


def paused_intervals(rows: list[dict]) -> list[tuple[float, float]]:
    """When a rollout engine sat paused (its responses open, nothing decoding): from the end of each of its
    `pause` spans to the start of its next `resume`."""
    by_worker: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["kind"] == "span" and r["role"] == "rollout" and r["stage"] in ("pause", "resume"):
            by_worker.setdefault(worker(r), []).append(r)
    out = []
    for spans in by_worker.values():
        spans.sort(key=lambda r: r["t0"])
        out += [(a["t1"], b["t0"]) for a, b in zip(spans, spans[1:], strict=False)
                if a["stage"] == "pause" and b["stage"] == "resume"]
    return out


def idle_fractions(rows: list[dict], t0: float, t1: float) -> dict[str, float]:
    """role -> share of [t0, t1] in which none of that role's workers was busy."""
    window = max(t1 - t0, 1e-9)
    roles = sorted({r["role"] for r in rows})
    return {role: 1.0 - covered_s(busy_intervals(rows, role, t1), t0, t1) / window for role in roles}
