"""`openrlhf-oppo plot`: pictures of a run's timeline (matplotlib, PNG).

    openrlhf-oppo plot timeline RUN_DIR [--out PNG] [--from-step K] [--steps N]
    openrlhf-oppo plot compare RUN_A RUN_B [--out PNG] [--from-step K] [--steps N]
    openrlhf-oppo plot lengths RUN_DIR [--out PNG]

`timeline`: a Gantt chart, one row per worker (driver, each rollout engine, reward,
reference, actor and critic ranks), one colour per stage; under each engine its
responses in lanes, a bar from a response's start to its end (hatched: it crossed a
weight sync, i.e. was carried). Dotted lines: steps (the driver starts generating).
`compare` stacks two runs on one time scale. `lengths` is the histogram of response
lengths. Reads `RUN_DIR/timeline/` (openrlhf_oppo.timeline).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from openrlhf_oppo import timeline

ROLE_ORDER = ("driver", "rollout", "reward", "ref", "actor", "critic")
STAGE_COLOURS = {
    "generate": "#c7dcef", "make_experience": "#fdd0a2", "train": "#a1d99b", "weight_sync": "#bcbddc",
    "pause": "#636363", "resume": "#969696", "load_weights": "#756bb1",
    "prefill": "#fd8d3c", "score": "#d94801", "ref_logprobs": "#6baed6", "old_logprobs": "#2171b5",
    "values": "#9e9ac8", "sample": "#74c476",
}
SAMPLE_LANES_MAX = 24  # responses drawn in at most this many lanes per engine


def _workers(rows: list[dict]) -> list[tuple]:
    """(role, host, pid) of every worker, by role, then in order of first record (a stable sort)."""
    rank = {role: i for i, role in enumerate(ROLE_ORDER)}
    return sorted(dict.fromkeys(timeline.worker(r) for r in rows), key=lambda w: rank.get(w[0], len(rank)))


def _lanes(samples: list[dict]) -> list[int]:
    """Greedy interval packing: a lane per response, reused once its last response ended."""
    ends: list[float] = []
    out = []
    for s in samples:
        lane = next((i for i, end in enumerate(ends) if end <= s["t0"]), None)
        if lane is None and len(ends) < SAMPLE_LANES_MAX:
            lane = len(ends)
            ends.append(0.0)
        elif lane is None:  # lanes full: share the one that frees first
            lane = min(range(len(ends)), key=ends.__getitem__)
        ends[lane] = s["t1"]
        out.append(lane)
    return out


def step_starts(rows: list[dict]) -> list[float]:
    return [r["t0"] for r in timeline.stage_spans(rows, "driver", "generate")]


def window(rows: list[dict], from_step: int, steps: int | None) -> tuple[float, float]:
    starts = step_starts(rows) or [min(r["t0"] for r in rows)]
    t0 = starts[min(from_step, len(starts) - 1)]
    end = max(r["t1"] for r in rows)
    if steps is not None and from_step + steps < len(starts):
        end = starts[from_step + steps]
    return t0, end


def draw(ax, rows: list[dict], title: str, from_step: int = 0, steps: int | None = None) -> None:
    t0, t1 = window(rows, from_step, steps)
    rows = [r for r in rows if r["t1"] >= t0 and r["t0"] <= t1]
    syncs = [(r["t0"], r["t1"]) for r in timeline.stage_spans(rows, "driver", "weight_sync")]
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
            lanes = _lanes(samples)
            for s, lane in zip(samples, lanes):
                carried = any(s["t0"] < a and s["t1"] > b for a, b in syncs)
                ax.broken_barh([(s["t0"] - t0, s["t1"] - s["t0"])], (y + lane - 0.35, 0.7),
                               color=STAGE_COLOURS["sample"], hatch="///" if carried else None,
                               edgecolor="#238b45", linewidth=0.3, label="decode (response)")
            labels.append((y + (max(lanes) / 2), f"{name} responses"))
            y += max(lanes) + 1
    for s in step_starts(rows):
        if t0 <= s <= t1:
            ax.axvline(s - t0, color="k", linestyle=":", linewidth=0.8)
    ax.set_yticks([p for p, _ in labels], [n for _, n in labels], fontsize=7)
    ax.set_ylim(y - 0.5, -0.6)
    ax.set_xlim(0, t1 - t0)
    ax.set_xlabel("seconds")
    ax.set_title(title, fontsize=9)
    handles = {}
    for h, lab in zip(*ax.get_legend_handles_labels()):
        handles.setdefault(lab, h)
    ax.legend(handles.values(), handles.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0))


def _height(rows: list[dict]) -> float:
    return 2.0 + 0.18 * (len(_workers(rows)) + SAMPLE_LANES_MAX)


def plot_timeline(run_dir: Path, out: Path | None, from_step: int = 0, steps: int | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _read(run_dir)
    fig, ax = plt.subplots(figsize=(12, _height(rows)))
    draw(ax, rows, run_dir.name, from_step, steps)
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
    for name, runs in (("timeline", 1), ("compare", 2), ("lengths", 1)):
        q = sub.add_parser(name)
        q.add_argument("runs", nargs=runs, type=Path, metavar="RUN_DIR")
        q.add_argument("--out", type=Path, default=None, help="PNG path (default: in the (last) run directory)")
        if name != "lengths":
            q.add_argument("--from-step", type=int, default=0, help="start the axis at this step (0: the first)")
            q.add_argument("--steps", type=int, default=None, help="draw this many steps (default: to the end)")
    args = p.parse_args(argv)
    if args.what == "timeline":
        plot_timeline(args.runs[0], args.out, args.from_step, args.steps)
    elif args.what == "compare":
        plot_compare(*args.runs, args.out, args.from_step, args.steps)
    else:
        plot_lengths(args.runs[0], args.out)
    return 0
