"""Where a run's step time goes, from its timeline: the driver's seconds a step in each stage
(waiting for rollouts, experience making, training, weight sync) over the measured steps,
and how long the engine decoded while the trainer trained. `bench schedules` prints it for
each schedule's first repeat; it explains a ratio, it does not make one."""

from __future__ import annotations

from pathlib import Path

from openrlhf_oppo import timeline
from openrlhf_oppo.bench.table import name_width

DRIVER_STAGES = ("generate", "make_experience", "train", "weight_sync")


def stage_seconds(rows: list[dict], t0: float, t1: float, steps: int) -> dict[str, float]:
    """Seconds a step over ``[t0, t1]`` (``steps`` steps): each driver stage, and
    ``decode_during_train``: the time some response was decoding (open on an engine not paused) while the
    driver trained.
    The driver's spans of an async schedule overlap (its rollouts run in another actor), so
    the stages need not add up to the step."""
    out = {stage: timeline.covered_s([(r["t0"], r["t1"]) for r in timeline.stage_spans(rows, "driver", stage)],
                                     t0, t1) / steps for stage in DRIVER_STAGES}
    decoding = timeline.subtract([(r["t0"], r["t1"]) for r in rows if r["kind"] == "sample"],
                                 timeline.paused_intervals(rows))
    trains = [(r["t0"], r["t1"]) for r in timeline.stage_spans(rows, "driver", "train")]
    out["decode_during_train"] = sum(timeline.covered_s(decoding, max(a, t0), min(b, t1))
                                     for a, b in trains if b > t0 and a < t1) / steps
    return out


def run_breakdown(root: Path, walls: list[float]) -> dict[str, float] | None:
    """`stage_seconds` between the first and last of ``walls`` (the measured steps' event times)."""
    if len(walls) < 2 or not (root / "timeline").is_dir():
        return None
    return stage_seconds(timeline.read(root / "timeline"), walls[0], walls[-1], len(walls) - 1)


def print_breakdown(per_schedule: dict[str, dict[str, float] | None], repeat: int = 0) -> None:
    rows = {s: b for s, b in per_schedule.items() if b}
    if not rows:
        return
    cols = [*DRIVER_STAGES, "decode_during_train"]
    print(f"where the time goes (repeat {repeat}; seconds a step from the timeline: the driver's stages, and "
          "decoding while it trains)")
    w = name_width(rows) + 1
    print(f"{'schedule':{w}}" + "".join(f"{c:>20}" for c in cols))
    for schedule, b in rows.items():
        print(f"{schedule:{w}}" + "".join(f"{b[c]:20.2f}" for c in cols))
