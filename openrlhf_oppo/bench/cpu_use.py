"""Where a run's CPU goes: every process's CPU seconds, sampled while it runs.

`bench schedules` samples each run (`RUN_DIR/cpu.jsonl`): every `interval_s`, the user +
system CPU seconds each process of the run has used so far (the launcher, Ray's daemons, the
driver, each Ray actor by its process title, vLLM's engine core; `processes.run_processes`),
summed by process name. A process that exited keeps its last figure, so a name's total only
grows. Over a run's measured steps (between two step events) it gives:

    cores busy      CPU seconds / wall seconds: how many of the host's cores the run kept busy
    CPU-s a step    CPU seconds / steps, in all and by process name
    CPU-s / 1k tok  CPU seconds / trained response tokens x 1,000: the cost of the work

A step is (trained tokens a step) x (CPU-s per token) / (cores busy), so one schedule's mean step
s over another's is the product of those three ratios (`factors`): how much work its steps held,
what the work cost, and how much of the host it kept busy. On a host without a GPU every role
(engine, trainer, scorers) runs on the same cores, and cores busy cannot pass the host's cores:
at equal work a schedule can be at most (CPU-s per token ratio) x cores / (the other's cores
busy) faster (`ceiling`). No overlap passes that; only less CPU per token, or more cores, can.
"""

from __future__ import annotations

import json
import os
import threading
import time
from bisect import bisect_left
from collections import Counter
from pathlib import Path

from openrlhf_oppo.bench.processes import IDLE_NAMES, run_processes
from openrlhf_oppo.bench.table import name_width

FILE = "cpu.jsonl"


def host() -> dict:
    """The cores this process may run on, and whether the host has an NVIDIA GPU (then the
    models' work is not on the cores and the ceiling does not apply)."""
    return {"cores": len(os.sched_getaffinity(0)), "gpu": Path("/dev/nvidia0").exists()}


class Sampler(threading.Thread):
    """Writes `out`: a first line `{"host": host()}`, then every `interval_s` seconds
    `{"t": wall time, "cpu": {name: CPU seconds so far}}` for the processes under `root_pid`
    (default: this one). A context manager: starts on entry; on exit stops, takes a last sample."""

    def __init__(self, out: Path, interval_s: float = 1.0, root_pid: int | None = None):
        super().__init__(daemon=True, name="cpu-sampler")
        self.out = Path(out)
        self.interval_s = interval_s
        self.root_pid = root_pid or os.getpid()
        self.stop = threading.Event()
        self.last: dict[int, tuple[str, float]] = {}  # pid -> (name, CPU seconds at its last sample)

    def sample(self) -> dict:
        import psutil

        t = time.time()
        for pid, name in run_processes(self.root_pid).items():
            try:
                cpu = psutil.Process(pid).cpu_times()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            # a process is named by its latest title (a Ray worker starts as default_worker.py, pools as
            # ray::IDLE, then takes its actor's), except that ray::IDLE does not undo an actor's
            known = self.last.get(pid, (name, 0.0))[0]
            self.last[pid] = (known if name in IDLE_NAMES else name, cpu.user + cpu.system)
        totals: Counter = Counter()
        for name, cpu in self.last.values():
            totals[name] += cpu
        row = {"t": round(t, 3), "cpu": {n: round(v, 3) for n, v in sorted(totals.items())}}
        with open(self.out, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        return row

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(self.interval_s)

    def __enter__(self) -> Sampler:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps({"host": host()}) + "\n")
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.join()
        self.sample()


def read(path: Path) -> tuple[dict, list[dict]]:
    """(host, samples in time order) from a `cpu.jsonl`; ({}, []) when there is none."""
    if not path.exists():
        return {}, []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        return {}, []
    samples = sorted((r for r in lines if "t" in r), key=lambda r: r["t"])
    return lines[0].get("host", {}), samples


def at(samples: list[dict], t: float) -> dict[str, float]:
    """Each name's CPU seconds at wall time `t`, linear between the samples around it (the
    first or last sample outside them; a name not yet seen counts 0)."""
    times = [s["t"] for s in samples]
    i = bisect_left(times, t)
    if i == 0 or i == len(samples):
        return dict(samples[min(i, len(samples) - 1)]["cpu"])
    a, b = samples[i - 1], samples[i]
    w = (t - a["t"]) / (b["t"] - a["t"])
    return {n: a["cpu"].get(n, 0.0) + w * (v - a["cpu"].get(n, 0.0)) for n, v in b["cpu"].items()}


def window(path: Path, t0: float, t1: float, steps: int, tokens: float | None) -> dict:
    """The CPU figures of a run's measured steps, wall times `t0` to `t1` (`steps` steps,
    `tokens` trained response tokens); {} without samples spanning the window."""
    head, samples = read(path)
    if len(samples) < 2 or samples[0]["t"] > t0 or samples[-1]["t"] < t1 or t1 <= t0 or steps < 1:
        return {}
    start, end = at(samples, t0), at(samples, t1)
    used = {n: v - start.get(n, 0.0) for n, v in end.items()}
    total = sum(used.values())
    return {
        "cores_busy": total / (t1 - t0),
        "cpu_s_per_step": total / steps,
        "cpu_s_per_ktok": 1000 * total / tokens if tokens else None,
        "cpu_by_process": {n: v / steps for n, v in sorted(used.items(), key=lambda kv: -kv[1])},
        "host": head,
    }


def factors(base: dict, run: dict, cores: int | None = None) -> dict[str, float] | None:
    """`base`'s mean step s / `run`'s (two `bench schedules` run summaries), as the product of
    three factors over their measured steps, exactly:
        work           base's trained tokens a step / run's (below 1: run's steps held more)
        cpu_per_token  base's CPU seconds per trained token / run's
        cores_busy     run's cores busy / base's
    and, given the host's `cores` (no GPU), `ceiling`: the product at equal work with every core
    busy in run, cpu_per_token x cores / base's cores busy: the most run's CPU cost lets it reach on
    that host. None where a figure is missing."""
    keys = ("mean_step_s", "trained_tokens_per_s", "cpu_s_per_ktok", "cores_busy")
    if any(not r.get(k) for r in (base, run) for k in keys):
        return None
    out = {
        "work": base["trained_tokens_per_s"] * base["mean_step_s"] / (run["trained_tokens_per_s"] * run["mean_step_s"]),
        "cpu_per_token": base["cpu_s_per_ktok"] / run["cpu_s_per_ktok"],
        "cores_busy": run["cores_busy"] / base["cores_busy"],
    }
    if cores:
        out["ceiling"] = out["cpu_per_token"] * cores / base["cores_busy"]
    return out


def print_table(first_runs: dict[str, dict], top: int = 6) -> None:
    """Each schedule's first repeat: cores busy, CPU seconds a step, per 1k trained tokens,
    and the processes that used the most."""
    rows = {s: r for s, r in first_runs.items() if r and r.get("cpu_s_per_step") is not None}
    if not rows:
        return
    cores = next(iter(rows.values()))["host"].get("cores", "?")
    print(f"where the CPU goes (repeat 0; CPU seconds of every process of the run over the measured steps, "
          f"{cores} cores)")
    w = name_width(rows) + 1
    print(f"{'schedule':{w}}{'cores busy':>11}{'CPU-s a step':>13}{'CPU-s/1k tok':>13}  most CPU-s a step")
    for schedule, r in rows.items():
        per_ktok = "-" if r["cpu_s_per_ktok"] is None else f"{r['cpu_s_per_ktok']:.2f}"
        most = ", ".join(f"{n} {v:.2f}" for n, v in list(r["cpu_by_process"].items())[:top])
        print(f"{schedule:{w}}{r['cores_busy']:11.2f}{r['cpu_s_per_step']:13.2f}{per_ktok:>13}  {most}")
