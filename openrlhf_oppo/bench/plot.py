"""`openrlhf-oppo plot`: pictures of a run's timeline (matplotlib, PNG).

    openrlhf-oppo plot timeline RUN_DIR [--out PNG] [--from-step K] [--steps N]
    openrlhf-oppo plot compare RUN_A RUN_B [--out PNG] [--from-step K] [--steps N]
    openrlhf-oppo plot lengths RUN_DIR [--out PNG]
    openrlhf-oppo plot trace RUN_DIR [--out JSON]

`timeline`: a Gantt chart of a few steps, one row per worker (driver, each rollout engine,
reward, reference, actor and critic ranks), one colour per stage; under each engine its
responses in lanes, a bar from a response's start to its end (red and hatched: it was
carried across a step's batch). Dotted lines: steps (the driver starts generating),
numbered from 1 on the top axis. A run of more than DEFAULT_WINDOW_MAX_STEPS steps is drawn
for its last DEFAULT_WINDOW_STEPS unless --from-step or --steps is given. `compare` stacks
two runs on one time scale. `lengths` is the histogram of response lengths. `trace`: the
whole run as Chrome trace-event JSON for Perfetto (bench.trace_events). Reads
`RUN_DIR/timeline/` (openrlhf_oppo.timeline).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from openrlhf_oppo import timeline
from openrlhf_oppo.bench import trace_events
from openrlhf_oppo.bench.trace_events import step_starts

ROLE_ORDER = ("driver", "rollout", "reward", "ref", "actor", "critic")
STAGE_COLOURS = {
    "generate": "#c7dcef", "make_experience": "#fdd0a2", "train": "#a1d99b", "weight_sync": "#bcbddc",
    "pause": "#636363", "resume": "#969696", "load_weights": "#756bb1",
    "prefill": "#fd8d3c", "score": "#d94801", "ref_logprobs": "#6baed6", "old_logprobs": "#2171b5",
    "values": "#9e9ac8", "sample": "#74c476",
}
SAMPLE_LANES_MAX = 24  # responses drawn in at most this many lanes per engine
CARRIED_COLOUR = "#fb6a4a"
DEFAULT_WINDOW_MAX_STEPS = 8  # a run of more steps is unreadable in one PNG ...
DEFAULT_WINDOW_STEPS = 4  # ... and is drawn for its last this many, unless a window is given
STEP_LABELS_MAX = 16  # label every k-th step on the top axis past this many
PERFETTO = "open it at https://ui.perfetto.dev or chrome://tracing"


def _workers(rows: list[dict]) -> list[tuple]:
    """(role, host, pid) of every worker, by role, then in order of first record (a stable sort)."""
    rank = {role: i for i, role in enumerate(ROLE_ORDER)}
    return sorted(dict.fromkeys(timeline.worker(r) for r in rows), key=lambda w: rank.get(w[0], len(rank)))


def window(rows: list[dict], from_step: int, steps: int | None) -> tuple[float, float]:
    starts = step_starts(rows) or [min(r["t0"] for r in rows)]
    t0 = starts[min(from_step, len(starts) - 1)]
    end = max(r["t1"] for r in rows)
    if steps is not None and from_step + steps < len(starts):
        end = starts[from_step + steps]
    return t0, end


def draw(ax, rows: list[dict], title: str, from_step: int = 0, steps: int | None = None) -> None:
    t0, t1 = window(rows, from_step, steps)
    run_steps = trace_events.steps(rows)  # of the whole run: a batch before the window still carries
    rows = [r for r in rows if r["t1"] >= t0 and r["t0"] <= t1]
    labels = []
    y = 0
    counts: dict[str, int] = {}
    for role, host, pid in _workers(rows):
        mine = [r for r in rows if timeline.worker(r) == (role, host, pid)]
        spans = [r for r in mine if r["kind"] == "span"]
        samples = sorted((r for r in mine if r["kind"] == "sample"), key=lambda r: r["t0"])
        name = f"{role} {counts.setdefault(role, 0)}"
        counts[role] += 1
        if spans or not samples:
            for r in spans:
                ax.broken_barh([(r["t0"] - t0, r["t1"] - r["t0"])], (y - 0.4, 0.8),
                               color=STAGE_COLOURS.get(r["stage"], "#cccccc"), label=r["stage"])
            labels.append((y, name))
            y += 1
        if samples:
            lanes = trace_events.lanes(samples, SAMPLE_LANES_MAX)
            for s, lane in zip(samples, lanes):
                carried = bool(trace_events.carried_at(s, run_steps))
                # facecolor, not color: with `color` given the hatch is not drawn
                ax.broken_barh([(s["t0"] - t0, s["t1"] - s["t0"])], (y + lane - 0.35, 0.7),
                               facecolor=CARRIED_COLOUR if carried else STAGE_COLOURS["sample"],
                               hatch="///" if carried else None, edgecolor="#238b45", linewidth=0.3,
                               label="carried response" if carried else "decode (response)")
            labels.append((y + (max(lanes) / 2), f"{name} responses"))
            y += max(lanes) + 1
    shown = [s for s in run_steps if t0 <= s.start_s <= t1]
    for s in shown:
        ax.axvline(s.start_s - t0, color="k", linestyle=":", linewidth=0.8)
    _label_steps(ax, shown, t0)
    ax.set_yticks([p for p, _ in labels], [n for _, n in labels], fontsize=7)
    ax.set_ylim(y - 0.5, -0.6)
    ax.set_xlim(0, t1 - t0)
    ax.set_xlabel("seconds")
    ax.set_title(title, fontsize=9)
    handles = {}
    for h, lab in zip(*ax.get_legend_handles_labels()):
        handles.setdefault(lab, h)
    ax.legend(handles.values(), handles.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0))


def _label_steps(ax, shown: list[trace_events.Step], t0: float) -> None:
    """"step N" at each shown step's start on a top axis (every k-th one past STEP_LABELS_MAX)."""
    every = max(1, -(-len(shown) // STEP_LABELS_MAX))
    labelled = shown[::every]
    top = ax.secondary_xaxis("top")
    top.set_xticks([s.start_s - t0 for s in labelled], [f"step {s.number}" for s in labelled], fontsize=7)


def default_window(run_dir: Path, rows: list[dict]) -> tuple[int, int | None]:
    """(from_step, steps) when none was asked for: the whole run, or for a run of more than
    DEFAULT_WINDOW_MAX_STEPS steps its last DEFAULT_WINDOW_STEPS, saying so and how to choose."""
    n = len(trace_events.steps(rows))  # numbered as the trace and the progress line number them
    if n <= DEFAULT_WINDOW_MAX_STEPS:
        return 0, None
    first = n - DEFAULT_WINDOW_STEPS
    print(f"{run_dir}: {n} steps, too many for one picture: drawing steps {first + 1}-{n} "
          f"(--from-step {first} --steps {DEFAULT_WINDOW_STEPS}). Choose others with --from-step K "
          f"(K = step number - 1) and --steps N; the whole run: openrlhf-oppo plot trace {run_dir}")
    return first, DEFAULT_WINDOW_STEPS


def _height(rows: list[dict]) -> float:
    return 2.0 + 0.18 * (len(_workers(rows)) + SAMPLE_LANES_MAX)


def plot_timeline(run_dir: Path, out: Path | None, from_step: int | None = None, steps: int | None = None) -> Path:
    """`from_step` None and `steps` None: `default_window`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _read(run_dir)
    if from_step is None and steps is None:
        from_step, steps = default_window(run_dir, rows)
    fig, ax = plt.subplots(figsize=(12, _height(rows)))
    draw(ax, rows, run_dir.name, from_step or 0, steps)
    return _save(fig, out or run_dir / "timeline.png")


def plot_compare(run_a: Path, run_b: Path, out: Path | None, from_step: int = 0, steps: int | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a, b = _read(run_a), _read(run_b)
    fig, (ax_a, ax_b) = plt.subplots(2, 1, figsize=(12, _height(a) + _height(b)), sharex=True)
    draw(ax_a, a, run_a.name, from_step, steps)
    draw(ax_b, b, run_b.name, from_step, steps)
    span = max(ax_a.get_xlim()[1], ax_b.get_xlim()[1])
    ax_a.set_xlim(0, span)
    return _save(fig, out or run_b / f"compare-{run_a.name}.png")


def response_lengths(rows: list[dict]) -> list[int]:
    """Tokens of every finished rollout response (held tokens of a restarted one included):
    those started while the driver generated (not the launcher's probe after a weight sync)."""
    steps = [(r["t0"], r["t1"]) for r in timeline.stage_spans(rows, "driver", "generate")]
    return [r["tokens"] + r.get("held", 0) for r in rows if r["kind"] == "sample" and r["finish"] != "abort"
            and any(a <= r["t0"] <= b for a, b in steps)]


def plot_lengths(run_dir: Path, out: Path | None) -> Path:
    import statistics

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = response_lengths(_read(run_dir))
    if not lengths:
        raise ValueError(f"{run_dir}: the timeline holds no finished response")
    med = statistics.median(lengths)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.hist(lengths, bins=60, color=STAGE_COLOURS["sample"], edgecolor="#238b45", linewidth=0.3)
    ax.set_yscale("log")
    ax.axvline(med, color="k", linestyle="--", linewidth=0.8)
    far = sum(1 for n in lengths if n > 10 * med) / len(lengths)
    ax.set_title(f"{run_dir.name}: {len(lengths)} responses, median {med:.0f} tokens, "
                 f"max {max(lengths)}, {far:.1%} longer than 10x median", fontsize=9)
    ax.set_xlabel("response tokens")
    ax.set_ylabel("responses (log)")
    return _save(fig, out or run_dir / "lengths.png")


def plot_trace(run_dir: Path, out: Path | None) -> Path:
    try:
        path = trace_events.write_chrome_trace(run_dir, out)
    except FileNotFoundError as exc:  # one line from the CLI, as `_read`'s
        raise ValueError(str(exc)) from exc
    print(f"wrote {path}: {PERFETTO}")
    return path


def _read(run_dir: Path) -> list[dict]:
    rows = timeline.read(run_dir / "timeline")
    if not rows:
        raise ValueError(f"{run_dir}: no timeline records under {run_dir / 'timeline'} "
                         "(a run of `openrlhf-oppo train`)")
    return rows


def _save(fig, out: Path) -> Path:
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="openrlhf-oppo plot", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    for name, runs in (("timeline", 1), ("compare", 2), ("lengths", 1), ("trace", 1)):
        q = sub.add_parser(name)
        q.add_argument("runs", nargs=runs, type=Path, metavar="RUN_DIR")
        if name == "trace":
            q.add_argument("--out", type=Path, default=None,
                           help="JSON path (default: RUN_DIR/timeline.trace.json)")
        else:
            q.add_argument("--out", type=Path, default=None, help="PNG path (default: in the (last) run directory)")
        if name in ("timeline", "compare"):
            default = "the first" if name == "compare" else (
                f"the first, or the last {DEFAULT_WINDOW_STEPS} steps of a run of more than {DEFAULT_WINDOW_MAX_STEPS}")
            q.add_argument("--from-step", type=int, default=None,
                           help=f"start the axis at this step, counted from 0: step N is N - 1 (default: {default})")
            q.add_argument("--steps", type=int, default=None, help="draw this many steps (default: to the end)")
    args = p.parse_args(argv)
    if args.what == "timeline":
        plot_timeline(args.runs[0], args.out, args.from_step, args.steps)
    elif args.what == "compare":
        plot_compare(*args.runs, args.out, args.from_step or 0, args.steps)
    elif args.what == "trace":
        plot_trace(args.runs[0], args.out)
    else:
        plot_lengths(args.runs[0], args.out)
    return 0
