"""`python -m oppo_lab soak`: a long run with every process's memory recorded.

    python -m oppo_lab soak --config configs/tiny-cpu.yaml --steps 200 --output runs/soak [-- extra flags]

Runs `openrlhf-oppo train` (OPPO by default) for at least `--steps` PPO steps: the
prompt set is read `--train.num_episodes` times, `--data.max_samples` prompts a pass,
sized so that passes × prompts ≥ (steps + 2) × rollout batch size. Every
`--interval-s` seconds it records the RSS of every process of the run (the launcher,
and everything in the session the launcher starts the run in: Ray's daemons, the
driver, each Ray actor by its process title, e.g. `ray::OppoRolloutActor`, vLLM's
engine core, …) with the steps done by then (rows of `RUN_DIR/oppo_metrics.jsonl`).
Writes to the run directory:

    rss.jsonl        {"t", "pid", "name", "rss_mb", "step"} per process per sample
    soak.png         total and per-process RSS over steps; reward-actor KV tokens per step
    soak.json        the summary printed at the end

Summary per process: RSS at 10 % of the run's steps and at the end, and the growth
per 100 steps between the two; KV tokens (`oppo/scorer_kv_tokens`, most held after a
reward call in a step, summed over actors) at most vs the budget
(`oppo/scorer_kv_budget_tokens`). RSS counts shared pages in every process that maps
them, so the total overstates the machine's use; its growth is what to read.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import threading
import time
from pathlib import Path

from openrlhf_oppo.bench.processes import IDLE_NAMES, run_processes

KV_KEY = "oppo/scorer_kv_tokens"
KV_BUDGET_KEY = "oppo/scorer_kv_budget_tokens"
EARLY = 0.1  # growth is measured from this fraction of the run's steps (start-up left out)
MIN_SPAN = 0.2  # ... over at least this fraction of them; a shorter-lived process gets no rate


# ------------------------------------------------------------------ processes

def rss_mb(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as fh:
            return sum(1 for _ in fh)
    except FileNotFoundError:
        return 0


class Sampler(threading.Thread):
    """Appends one row per process of the run to `out` every `interval_s` seconds."""

    def __init__(self, root_pid: int, out: Path, metrics: Path, interval_s: float):
        super().__init__(daemon=True, name="soak-sampler")
        self.root_pid, self.out, self.metrics, self.interval_s = root_pid, out, metrics, interval_s
        self.stop = threading.Event()

    def sample(self) -> int:
        t, step = time.time(), count_lines(self.metrics)
        rows = []
        for pid, name in run_processes(self.root_pid).items():
            rss = rss_mb(pid)
            if rss is not None:
                rows.append({"t": round(t, 3), "pid": pid, "name": name, "rss_mb": round(rss, 1), "step": step})
        with open(self.out, "a") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
        return len(rows)

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(self.interval_s)


# ------------------------------------------------------------------ summary

def labels(rows: list[dict]) -> dict[int, str]:
    """pid -> "name [pid]", the name being the last one other than an idle worker's."""
    names: dict[int, str] = {}
    for r in sorted(rows, key=lambda r: r["t"]):
        if r["pid"] not in names or r["name"] not in IDLE_NAMES:
            names[r["pid"]] = r["name"]
    return {pid: f"{name} [{pid}]" for pid, name in names.items()}


def trim(rows: list[dict]) -> list[dict]:
    """Rows in time order before the last step was logged: the run ends right after it,
    so sweeps from then on catch it being torn down (processes ending, the total falling)."""
    rows = sorted(rows, key=lambda r: r["t"])
    last_step = max((r["step"] for r in rows), default=0)
    kept = [r for r in rows if r["step"] < last_step]
    return kept or rows


def _rate(series: list[tuple[int, float]], from_step: float, total_steps: int) -> tuple[float, float | None]:
    """(RSS at the first sample at or after `from_step`, MB per 100 steps from there to the end)."""
    start = next((s for s in series if s[0] >= from_step), series[0])
    end = series[-1]
    span = end[0] - start[0]
    return start[1], (end[1] - start[1]) / span * 100 if span > 0 and span >= MIN_SPAN * total_steps else None


def _growth(series: list[tuple[int, float]], total_steps: int) -> dict:
    """series: (step, rss) in time order -> RSS at EARLY of the run and at the end, growth per
    100 steps from EARLY to the end and over the second half (a bounded process slows down)."""
    early_mb, rate = _rate(series, EARLY * total_steps, total_steps)
    _, late_rate = _rate(series, total_steps / 2, total_steps)
    return {"rss_early_mb": early_mb, "rss_end_mb": series[-1][1], "rss_max_mb": max(v for _, v in series),
            "first_step": series[0][0], "last_step": series[-1][0], "growth_mb_per_100_steps": rate,
            "late_growth_mb_per_100_steps": late_rate}


def _series(rows: list[dict]) -> tuple[dict[int, list[tuple[int, float]]], dict[float, list]]:
    """(pid -> [(step, RSS MB)], sample time -> [step, RSS MB summed over processes])."""
    per_pid: dict[int, list[tuple[int, float]]] = {}
    sweeps: dict[float, list] = {}
    for r in rows:
        per_pid.setdefault(r["pid"], []).append((r["step"], r["rss_mb"]))
        sweep = sweeps.setdefault(r["t"], [r["step"], 0.0])
        sweep[1] += r["rss_mb"]
    return per_pid, sweeps


def summarize(rows: list[dict], kv_rows: list[dict] | None = None) -> dict:
    """Per-process and total RSS growth from `rss.jsonl` rows; KV tokens from metrics rows."""
    steps = max((r["step"] for r in rows), default=0)
    rows = trim(rows)
    total_steps = max((r["step"] for r in rows), default=0)
    names = labels(rows)
    per_pid, sweeps = _series(rows)
    processes = [{"pid": pid, "name": names[pid], **_growth(series, total_steps)} for pid, series in per_pid.items()]
    processes.sort(key=lambda p: -p["rss_end_mb"])
    total = _growth([(s, v) for _, (s, v) in sorted(sweeps.items())], total_steps) if sweeps else None
    out = {"steps": steps, "measured_to_step": total_steps, "processes": processes, "total": total}
    kv = [(r.get("global_step", i + 1), r[KV_KEY]) for i, r in enumerate(kv_rows or []) if KV_KEY in r]
    if kv:
        budgets = [r[KV_BUDGET_KEY] for r in kv_rows if r.get(KV_BUDGET_KEY)]
        top = max(kv, key=lambda x: x[1])
        out["kv"] = {"max_tokens": top[1], "max_at_step": top[0], "budget_tokens": max(budgets) if budgets else None,
                     "early_max_tokens": max((v for s, v in kv if s <= max(1, EARLY * len(kv))), default=None),
                     "late_max_tokens": max((v for s, v in kv if s > len(kv) - max(1, EARLY * len(kv))), default=None)}
    return out


def _mb(v: float | None, signed: bool = False) -> str:
    return "-" if v is None else (f"{v:+.1f}" if signed else f"{v:.0f}")


def print_summary(summary: dict, min_rss_mb: float = 0.0) -> None:
    steps = summary["measured_to_step"]
    print(f"{'process':<48} {'steps':>9} {'RSS@10% MB':>11} {'RSS end MB':>11} {'max MB':>8} {'MB/100 steps':>13} "
          f"{'2nd half':>9}")
    shown = [p for p in summary["processes"] if p["rss_max_mb"] >= min_rss_mb]
    for p in shown + ([{"name": "all processes (sum)", **summary["total"]}] if summary["total"] else []):
        span = f"{p['first_step']}-{p['last_step']}"
        print(f"{p['name'][:48]:<48} {span:>9} {_mb(p['rss_early_mb']):>11} {_mb(p['rss_end_mb']):>11} "
              f"{_mb(p['rss_max_mb']):>8} {_mb(p['growth_mb_per_100_steps'], True):>13} "
              f"{_mb(p['late_growth_mb_per_100_steps'], True):>9}")
    hidden = len(summary["processes"]) - len(shown)
    if hidden:
        print(f"({hidden} processes under {min_rss_mb:.0f} MB not shown)")
    print(f"steps: {summary['steps']} (measured to step {steps}: the run is torn down after its last); RSS@10%: "
          f"the first sample at or after step {EARLY * steps:.0f}; MB/100 steps: "
          f"(end - RSS@10%) / steps between them x 100; 2nd half: the same from half the run "
          f"('-': alive under {MIN_SPAN:.0%} of the run)")
    kv = summary.get("kv")
    if kv:
        budget = kv["budget_tokens"]
        share = f" ({kv['max_tokens'] / budget:.2%} of it)" if budget else ""
        print(f"reward-actor KV tokens: max {kv['max_tokens']:.0f} (step {kv['max_at_step']}), "
              f"first 10% of steps {kv['early_max_tokens']:.0f}, last 10% {kv['late_max_tokens']:.0f}; "
              + (f"budget {budget:,.0f}{share}" if budget else "budget unknown"))


# ------------------------------------------------------------------ plot

def plot(rows: list[dict], kv_rows: list[dict], out: Path, title: str = "", top: int = 8) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = trim(rows)
    names = labels(rows)
    per_pid, sweeps = _series(rows)
    fig, (ax_total, ax_proc, ax_kv) = plt.subplots(3, 1, figsize=(11, 11), sharex=True,
                                                   gridspec_kw={"height_ratios": [1, 2.2, 1]})
    steps_total = [s for s, _ in sweeps.values()]
    ax_total.plot(steps_total, [v / 1024 for _, v in sweeps.values()], color="black", lw=1)
    ax_total.set_ylabel("RSS, all processes (GiB)")
    ax_total.set_title(title or "soak: memory of every process of the run")
    order = sorted(per_pid, key=lambda pid: -max(v for _, v in per_pid[pid]))
    cmap = plt.get_cmap("tab10")
    for rank, pid in enumerate(order):
        xs, ys = zip(*per_pid[pid])
        if rank < top:
            ax_proc.plot(xs, ys, lw=1.2, color=cmap(rank % 10), label=names[pid])
        else:
            ax_proc.plot(xs, ys, lw=0.6, color="#bbbbbb")
    ax_proc.set_ylabel("RSS per process (MB)")
    ax_proc.legend(fontsize=7, loc="upper left", ncol=2, title=f"largest {min(top, len(order))} of {len(order)} "
                   "(grey: the rest)", title_fontsize=7)
    kv = [(r.get("global_step", i + 1), r[KV_KEY]) for i, r in enumerate(kv_rows) if KV_KEY in r]
    if kv:
        xs, ys = zip(*kv)
        ax_kv.plot(xs, ys, lw=1, color="#d94801", label="KV tokens held (most after a call in the step)")
        budgets = [r[KV_BUDGET_KEY] for r in kv_rows if r.get(KV_BUDGET_KEY)]
        if budgets and max(budgets) <= 5 * max(ys):
            ax_kv.axhline(max(budgets), ls="--", color="grey", label="budget")
        elif budgets:
            ax_kv.text(0.99, 0.95, f"budget {max(budgets):,.0f} tokens (off the scale)", transform=ax_kv.transAxes,
                       ha="right", va="top", fontsize=8)
        ax_kv.legend(fontsize=7, loc="upper left")
    ax_kv.set_ylim(bottom=0)
    ax_kv.set_ylabel("reward-actor KV tokens")
    ax_kv.set_xlabel("PPO steps done")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# ------------------------------------------------------------------ the run

def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def prompt_count(flags: dict) -> int:
    """Prompts in the run's dataset: a local .jsonl file's lines, else the tiny task's."""
    from openrlhf_oppo.tasks import tiny

    path = flags.get("data.prompt_dataset")
    if path and Path(path).expanduser().is_file() and str(path).endswith(".jsonl"):
        return count_lines(Path(path).expanduser())
    return tiny.NUM_PROMPTS


def data_flags(steps: int, batch: int, prompts: int) -> tuple[int, int]:
    """(--data.max_samples, --train.num_episodes): passes over at most `prompts` prompts
    holding at least (steps + 2) × `batch` in all (a pass ends at the step that admits its
    last prompt; OPPO's Δ admits a few prompts ahead)."""
    need = (steps + 2) * batch
    episodes = math.ceil(need / prompts)
    return math.ceil(need / episodes), episodes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m oppo_lab soak", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/tiny-cpu.yaml", help="YAML run config")
    p.add_argument("--schedule", default="oppo", help="an OPPO schedule (its metrics give the steps and KV tokens)")
    p.add_argument("--steps", type=int, default=200, help="PPO steps to run (at least)")
    p.add_argument("--output", default="runs/soak", help="run directory")
    p.add_argument("--interval-s", type=float, default=2.0, help="seconds between RSS samples")
    p.add_argument("--timeout-s", type=float, default=None, help="end the run after this many seconds")
    p.add_argument("--report-only", action="store_true", help="run nothing: summarize and plot --output")
    p.add_argument("--min-rss-mb", type=float, default=50.0, 
                   help="processes smaller than this are left out of the table")
    p.add_argument("extra", nargs="*", help="after `--`: extra OpenRLHF flags")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    out = Path(args.output)
    rss_path, metrics_path = out / "rss.jsonl", out / "oppo_metrics.jsonl"
    returncode = 0
    if not args.report_only:
        from openrlhf_oppo.integrations.launch import train_run as train
        from openrlhf_oppo.integrations.launch import yaml_config

        flags = yaml_config.load(args.config).flags
        max_samples, episodes = data_flags(args.steps, int(flags.get("rollout.batch_size", 1)), prompt_count(flags))
        out.mkdir(parents=True, exist_ok=True)
        rss_path.unlink(missing_ok=True)
        metrics_path.unlink(missing_ok=True)  # the launcher clears it too; the sampler counts its rows
        print(
            f"[bench soak] {args.steps} steps: --data.max_samples {max_samples} --train.num_episodes {episodes}; "
            f"RSS every {args.interval_s:g}s -> {rss_path}",
            flush=True,
        )
        sampler = Sampler(os.getpid(), rss_path, metrics_path, args.interval_s)
        sampler.start()
        try:
            result = train.run(
                [
                    "--schedule",
                    args.schedule,
                    "--config",
                    args.config,
                    "--output",
                    str(out),
                    *(["--timeout-s", str(args.timeout_s)] if args.timeout_s else []),
                    "--",
                    "--data.max_samples",
                    str(max_samples),
                    "--train.num_episodes",
                    str(episodes),
                    *args.extra,
                ]
            )
            returncode = result.returncode
        finally:
            sampler.stop.set()
            sampler.join()
    rows, kv_rows = read_jsonl(rss_path), read_jsonl(metrics_path)
    if not rows:
        print(f"[bench soak] no RSS samples in {rss_path}")
        return returncode or 1
    summary = summarize(rows, kv_rows)
    summary["returncode"] = returncode
    (out / "soak.json").write_text(json.dumps(summary, indent=1))
    png = plot(
        rows,
        kv_rows,
        out / "soak.png",
        title=f"soak: {args.config}, schedule {args.schedule}, {summary['steps']} steps",
    )
    print_summary(summary, args.min_rss_mb)
    print(f"[bench soak] {out / 'soak.json'}, {png}")
    return returncode


if __name__ == "__main__":
    raise SystemExit(main())
