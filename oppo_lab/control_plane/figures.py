"""The figures of a `bench control-plane` run, from its raw measurements (`driver.run_step`):
driver CPU, rates, Ray messages, the emission-to-scorer lag of every token, and the checks that
every sample's tokens reached its scorer exactly once and in order.

Two windows: the whole streaming phase (first call to the batch), and the *full* window, from
the start until the first engine has a free slot and nothing waiting; in it every engine decodes
`sequences` samples at once, so the cluster emits its target rate and the driver carries it.
"""

from __future__ import annotations

import bisect
from array import array
from collections import Counter

import numpy as np

from oppo_lab.control_plane.driver import Workload

HALF_CORE = 0.5  # the target: the driver keeps up using less than this many cores
KEEPS_UP = 0.95  # ... receiving at least this share of what the engines emitted meanwhile


def figures(raw: dict, w: Workload, chunk_tokens: int) -> dict:
    t0, cpu0, thread0 = raw["start"]
    t_stream, cpu_stream, thread_stream = raw["stream_end"]
    t_end, cpu_end, _ = raw["end"]
    stream_s, stream_cpu_s = t_stream - t0, cpu_stream - cpu0
    tokens = raw["driver_tokens"]
    calls = Counter()
    for log in raw["engine_logs"] + raw["scorer_logs"]:
        calls.update(log["calls"])
    n_calls = sum(calls.values())
    lags_s, chunk_lags_s, checks = token_lags(raw["engine_logs"], raw["scorer_logs"], w.response_lengths())
    checks["rewards_exact"] = sum(raw["rewards"].get(sid) == n for sid, n in w.response_lengths().items())
    full = full_window(raw, w)
    out = {
        "chunk_tokens": chunk_tokens,
        "tokens": tokens,
        "emitted_tokens": checks["emitted_tokens"],
        "scored_tokens": checks["scored_tokens"],
        "stream_s": stream_s,
        "driver_cpu_s": stream_cpu_s,
        "driver_cores": stream_cpu_s / stream_s,
        # of driver_cpu_s, the Python main thread's (the generator); the rest is Ray's threads in the process
        "driver_main_thread_cpu_s": thread_stream - thread0,
        "driver_cpu_ms_per_1k_tokens": 1e6 * stream_cpu_s / max(tokens, 1),
        "tokens_per_s": tokens / stream_s,
        "target_tokens_per_s": w.target_tokens_per_s,
        "full": full,
        "driver_polls": raw["driver_polls"],
        # the driver's cost is mostly per delta and per call, not per token: how many tokens a delta carried
        "driver_deltas": raw["driver_deltas"],
        "deltas_per_s": raw["driver_deltas"] / stream_s,
        "tokens_per_delta": tokens / max(raw["driver_deltas"], 1),
        "chunk_records": sum(len(s["sids"]) for s in raw["scorer_logs"]),  # a sample's chunks in one call: one
        "calls": dict(calls),
        "ray_messages": 2 * n_calls,  # each call and its reply
        "ray_messages_per_s": 2 * n_calls / stream_s,
        "lag_ms": {q: 1e3 * float(v) for q, v in lag_quantiles(lags_s).items()},
        # each chunk's last token: the delay the control plane adds once a chunk is complete (lag_ms
        # adds the wait for the chunk to fill, up to C / tokens_per_s)
        "chunk_lag_ms": {q: 1e3 * float(v) for q, v in lag_quantiles(chunk_lags_s).items()},
        "experiences": raw["experiences"],
        "build_experiences_s": t_end - t_stream,
        "build_experiences_cpu_s": cpu_end - cpu_stream,
        "engines_cpu_s": sum(log["cpu_s"] for log in raw["engine_logs"]),
        "scorers_cpu_s": sum(log["cpu_s"] for log in raw["scorer_logs"]),
        "checks": checks,
    }

    out["target_met"] = bool(full["driver_cores"] < HALF_CORE and full["received_share"] >= KEEPS_UP)
    return out


def full_window(raw: dict, w: Workload) -> dict:
    """Rates while every engine is full: from the start to the first free slot with none waiting,
    read at the last driver note (`driver.TRACE_S`) before it."""
    t0, cpu0, _ = raw["start"]
    ends = [log["full_until_s"] for log in raw["engine_logs"] if log["full_until_s"] is not None]
    until = min(ends) if ends else raw["stream_end"][0]
    notes = [n for n in raw["trace"] if n[0] <= until]
    t, cpu, tokens = notes[-1] if notes else (t0, cpu0, 0)
    span_s = max(t - t0, 1e-9)
    emitted = sum(_emitted_by(times, pushed_to, t) for log in raw["engine_logs"]
                  for times, pushed_to in log["pushes"].values())
    return {
        "span_s": t - t0,
        "driver_cpu_s": cpu - cpu0,
        "driver_cores": (cpu - cpu0) / span_s,
        "driver_cpu_ms_per_1k_tokens": 1e6 * (cpu - cpu0) / max(tokens, 1),
        "tokens": tokens,
        "tokens_per_s": tokens / span_s,
        "emitted_tokens_per_s": emitted / span_s,  # what the engines managed (on a loaded host: below target)
        "received_share": tokens / max(emitted, 1),  # of what the engines emitted by then, what the driver had
    }


def _emitted_by(times: array, pushed_to: array, t: float) -> int:
    """Response tokens a sample's engine had pushed by `t` (its push times are ascending)."""
    k = bisect.bisect_right(times, t)
    return pushed_to[k - 1] if k else 0


def token_lags(engine_logs: list[dict], scorer_logs: list[dict], lengths: dict[int, int]
               ) -> tuple[np.ndarray, np.ndarray, dict]:
    """Every token's lag (s) from its push on the engine to its chunk's arrival on the scorer,
    the same for each chunk's last token, and the checks: each sample's chunks contiguous from
    token 0, none twice, ending at its length; its reward (the scorer's count) equal to it."""
    pushes = {sid: p for log in engine_logs for sid, p in log["pushes"].items()}
    sids = np.concatenate([np.frombuffer(s["sids"], dtype=np.int64) for s in scorer_logs])
    starts = np.concatenate([np.frombuffer(s["starts"], dtype=np.int64) for s in scorer_logs])
    ends = np.concatenate([np.frombuffer(s["ends"], dtype=np.int64) for s in scorer_logs])
    arrival = np.concatenate([np.frombuffer(s["arrival_s"], dtype=np.float64) for s in scorer_logs])
    order = np.lexsort((starts, sids))
    sids, starts, ends, arrival = sids[order], starts[order], ends[order], arrival[order]
    bounds = np.flatnonzero(np.diff(sids)) + 1
    finished = {sid: n for s in scorer_logs for sid, n in s["finished"].items()}
    lags, chunk_lags, bad = [], [], []
    for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, len(sids)]):
        if lo == hi:
            continue
        sid = int(sids[lo])
        st, en, arr = starts[lo:hi], ends[lo:hi], arrival[lo:hi]
        times, pushed_to = pushes.get(sid, (array("d"), array("i")))
        times, pushed_to = np.frombuffer(times, dtype=np.float64), np.frombuffer(pushed_to, dtype=np.int32)
        contiguous = st[0] == 0 and bool(np.all(st[1:] == en[:-1]))
        n = lengths.get(sid, -1)
        if not (contiguous and en[-1] == n and len(pushed_to) and pushed_to[-1] == n and finished.get(sid) == n):
            bad.append(sid)
            continue
        emit_s = np.repeat(times, np.diff(pushed_to, prepend=0))
        arrive_s = np.repeat(arr, en - st)
        lags.append(arrive_s - emit_s)
        chunk_lags.append(arr - emit_s[en - 1])
    seen = set(int(s) for s in np.unique(sids))
    missing = sorted(set(lengths) - seen)
    checks = {
        "samples": len(lengths),
        "samples_exact": len(seen) - len(bad),  # every token once, in order, finished at its length
        "bad_samples": sorted(bad)[:20],
        "missing_samples": missing[:20],
        "scorer_errors": sum(s["error_count"] for s in scorer_logs),
        "scorer_error_examples": [e for s in scorer_logs for e in s["errors"]][:5],
        "emitted_tokens": int(sum(np.frombuffer(e, dtype=np.int32)[-1] for _, e in pushes.values() if len(e))),
        "scored_tokens": int(ends.sum() - starts.sum()),
        "expected_tokens": sum(lengths.values()),
    }
    if not lags:
        return np.zeros(0), np.zeros(0), checks
    return np.concatenate(lags), np.concatenate(chunk_lags), checks


def lag_quantiles(lags_s: np.ndarray) -> dict[str, float]:
    if not len(lags_s):
        return {"p50": float("nan"), "p95": float("nan"), "max": float("nan"), "min": float("nan")}
    p50, p95 = np.percentile(lags_s, [50, 95])
    return {"p50": p50, "p95": p95, "max": lags_s.max(), "min": lags_s.min()}
