"""A run's timeline as Chrome trace-event JSON, to open and zoom in https://ui.perfetto.dev
or chrome://tracing (the format `torch.profiler` and `ray timeline` write).

    openrlhf-oppo plot trace RUN_DIR [--out PATH]     # -> RUN_DIR/timeline.trace.json

One process track a worker (`timeline.worker`: role, host, pid), driver and trainers first,
rollout engines last, and a `steps` track on top. Times are microseconds from the run's
first record. On a track:

    tid 0        the worker's spans (stages), one `X` event each
    tid 1, 2, …  an engine's responses, packed in lanes that never overlap; a response
                 carried across a step's batch is red (`cname`) with `args.carried`, and an
                 instant event `i` marks the batch it was carried at

Steps are numbered from 1, as the training progress line and OpenRLHF's `global_step`
count them: step N starts as the driver starts generating for the N-th time and takes its
batch as that generate ends; what is still decoding then is carried into step N + 1.

Stdlib only (reads `openrlhf_oppo.timeline`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from openrlhf_oppo import timeline

# driver and trainers first, rollout engines last; a role not named here sorts before the engines
TRACK_ROLE_ORDER = ("driver", "actor", "critic", "ref", "reward")
STEPS_PID = 1  # the steps track; workers get pids from 2 on (their OS pids may clash across hosts)
SPAN_TID = 0  # a worker's stages; its responses take tids from 1
CARRIED_COLOUR = "terrible"  # Chrome's reserved colour names (chrome://tracing honours them)
RESPONSE_COLOUR = "good"
UNFINISHED_COLOUR = "grey"


@dataclass(frozen=True)
class Step:
    """One training step as the driver's `generate` spans show it.

    Attributes:
        number (int): 1 for the first step of the timeline, as the progress line counts.
        start_s (float): the driver starts generating (`time.time()` seconds).
        batch_s (float): the driver's generate ends: the batch is taken, what still decodes is carried.
        end_s (float): the next step's start, or the run's last timestamp for the last step.
    """

    number: int
    start_s: float
    batch_s: float
    end_s: float


def steps(rows: list[dict]) -> list[Step]:
    """The run's steps, one a driver `generate` span. OpenRLHF asks its generator once more after
    the last step and gets nothing: a last generate that no driver `train` follows and in which no
    response started is that ask, not a step."""
    generate = sorted(timeline.stage_spans(rows, "driver", "generate"), key=lambda r: r["t0"])
    trains = [r["t0"] for r in timeline.stage_spans(rows, "driver", "train")]
    if generate and trains:
        last = generate[-1]
        trained_after = any(t >= last["t0"] for t in trains)
        decoded_in = any(r["kind"] in ("open", "sample") and last["t0"] <= r["t0"] <= last["t1"] for r in rows)
        if not trained_after and not decoded_in:
            generate = generate[:-1]
    end_s = max(r["t1"] for r in rows)
    ends = [g["t0"] for g in generate[1:]] + [end_s]
    return [Step(i + 1, g["t0"], g["t1"], end) for i, (g, end) in enumerate(zip(generate, ends))]


def step_starts(rows: list[dict]) -> list[float]:
    return [s.start_s for s in steps(rows)]


def lanes(intervals: list[dict], max_lanes: int | None = None) -> list[int]:
    """Greedy interval packing of rows sorted by `t0`: a lane each, reused once its last row ended.
    With `max_lanes` set, a row that finds every lane busy shares the one that frees first."""
    ends: list[float] = []
    out = []
    for s in intervals:
        lane = next((i for i, end in enumerate(ends) if end <= s["t0"]), None)
        if lane is None and (max_lanes is None or len(ends) < max_lanes):
            lane = len(ends)
            ends.append(0.0)
        elif lane is None:
            lane = min(range(len(ends)), key=ends.__getitem__)
        ends[lane] = s["t1"]
        out.append(lane)
    return out


def carried_at(response: dict, run_steps: list[Step]) -> list[Step]:
    """The steps whose batch `response` was carried across: it was decoding when the batch was
    taken, or it resumed from tokens `held` at a batch (the hybrid engine stops a request at the
    batch and decodes the sample on in a new one): then the last batch before it started."""
    across = [s for s in run_steps if response["t0"] < s.batch_s < response["t1"]]
    if across or not response.get("held"):
        return across
    before = [s for s in run_steps if s.batch_s <= response["t0"]]
    return before[-1:]


def responses(rows: list[dict], end_s: float) -> list[dict]:
    """Finished responses (`sample` rows) and, ending at `end_s` with `unfinished`, those whose
    `open` has no `sample` (still decoding when the run ended)."""
    def key(r: dict) -> tuple:
        return r.get("host", ""), r["pid"], r.get("key")

    finished = [r for r in rows if r["kind"] == "sample"]
    ended = {key(r) for r in finished}
    unfinished = [{**r, "t1": end_s, "unfinished": True} for r in rows
                  if r["kind"] == "open" and key(r) not in ended]
    return sorted(finished + unfinished, key=lambda r: (r["t0"], r["t1"]))


def _tracks(rows: list[dict]) -> list[tuple]:
    """Workers in track order: by role (TRACK_ROLE_ORDER, others, rollout), then first record."""
    def rank(w: tuple) -> int:
        role = w[0]
        if role == "rollout":
            return len(TRACK_ROLE_ORDER) + 1
        return TRACK_ROLE_ORDER.index(role) if role in TRACK_ROLE_ORDER else len(TRACK_ROLE_ORDER)

    return sorted(dict.fromkeys(timeline.worker(r) for r in rows), key=rank)


def _meta(name: str, pid: int, args: dict, tid: int | None = None) -> dict:
    event = {"name": name, "ph": "M", "pid": pid, "args": args}
    if tid is not None:
        event["tid"] = tid
    return event


def _complete(name: str, cat: str, t0: float, t1: float, origin: float, pid: int, tid: int, args: dict) -> dict:
    return {"name": name, "cat": cat, "ph": "X", "ts": (t0 - origin) * 1e6, "dur": max(0.0, (t1 - t0) * 1e6),
            "pid": pid, "tid": tid, "args": args}


def _step_events(run_steps: list[Step], origin: float) -> list[dict]:
    events = [_meta("process_name", STEPS_PID, {"name": "steps"}),
              _meta("process_sort_index", STEPS_PID, {"sort_index": 0})]
    for s in run_steps:
        events.append(_complete(f"step {s.number}", "step", s.start_s, s.end_s, origin, STEPS_PID, 0,
                                {"step": s.number, "batch_ts": (s.batch_s - origin) * 1e6}))
    return events


def _response_events(mine: list[dict], run_steps: list[Step], origin: float, pid: int) -> list[dict]:
    placed = lanes(mine)
    events = [_meta("thread_name", pid, {"name": f"responses {lane}"}, SPAN_TID + 1 + lane)
              for lane in sorted(set(placed))]
    for r, lane in zip(mine, placed):
        tid = SPAN_TID + 1 + lane
        label = f"sample {r['sample']}" if r.get("sample") is not None else f"response {r['key']}"
        at = carried_at(r, run_steps)
        args = {"key": r.get("key")}
        if r.get("unfinished"):
            args["unfinished"] = True
            colour = UNFINISHED_COLOUR
        else:
            args.update(tokens=r.get("tokens"), finish=r.get("finish"))
            colour = RESPONSE_COLOUR
        for field in ("sample", "held"):
            if r.get(field) is not None:
                args[field] = r[field]
        if at:
            args["carried"] = True
            args["carried_into_steps"] = [s.number + 1 for s in at]
            colour = CARRIED_COLOUR
        events.append({**_complete(label, "response", r["t0"], r["t1"], origin, pid, tid, args), "cname": colour})
        for s in at:
            events.append({"name": f"{label} carried into step {s.number + 1}", "cat": "carried", "ph": "i",
                           "s": "p", "ts": (s.batch_s - origin) * 1e6, "pid": pid, "tid": tid,
                           "cname": CARRIED_COLOUR, "args": {"key": r.get("key"), "step": s.number}})
    return events


def chrome_trace(rows: list[dict]) -> dict:
    """The JSON Object Format of Chrome's trace events for a run's timeline rows (`timeline.read`)."""
    if not rows:
        raise ValueError("no timeline rows to trace")
    rows = sorted(rows, key=lambda r: (r["t0"], r["t1"]))  # as `timeline.read` returns them
    origin = min(r["t0"] for r in rows)
    end_s = max(r["t1"] for r in rows)
    run_steps = steps(rows)
    answers = responses(rows, end_s)
    events = _step_events(run_steps, origin)
    for i, w in enumerate(_tracks(rows)):
        pid = STEPS_PID + 1 + i
        role, host, os_pid = w
        events += [_meta("process_name", pid, {"name": f"{role} {host}:{os_pid}"}),
                   _meta("process_sort_index", pid, {"sort_index": i + 1}),
                   _meta("thread_name", pid, {"name": "stages"}, SPAN_TID)]
        for r in rows:
            if r["kind"] == "span" and timeline.worker(r) == w:
                extra = {k: v for k, v in r.items() if k not in ("kind", "role", "host", "pid", "stage", "t0", "t1")}
                events.append(_complete(r["stage"], role, r["t0"], r["t1"], origin, pid, SPAN_TID, extra))
        events += _response_events([r for r in answers if timeline.worker(r) == w], run_steps, origin, pid)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"origin_unix_s": origin, "steps": len(run_steps),
                          "clock": "time.time() of each node, microseconds from origin_unix_s"}}


def write_chrome_trace(run_dir: Path, out: Path | None = None) -> Path:
    """Write `run_dir/timeline/`'s trace to `out` (default `run_dir/timeline.trace.json`); raises
    FileNotFoundError naming the folder when it holds no records."""
    folder = Path(run_dir) / "timeline"
    rows = timeline.read(folder)
    if not rows:
        raise FileNotFoundError(f"no timeline records under {folder} (written by `openrlhf-oppo train`)")
    trace = chrome_trace(rows)
    trace["otherData"]["run_dir"] = str(run_dir)
    out = Path(out) if out is not None else Path(run_dir) / "timeline.trace.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(trace, separators=(",", ":")))
    return out
