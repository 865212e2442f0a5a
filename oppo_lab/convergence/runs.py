"""`bench convergence`'s runs: what a name on --schedules runs (`Variant`), the config's task,
and every schedule for every seed through `openrlhf-oppo train`, seed-major. The bottom of
`oppo_lab.convergence`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from openrlhf_oppo.bench.schedules import stopped
from openrlhf_oppo.integrations.launch.schedules import all_schedules
from oppo_lab import schedules as _ablations  # noqa: F401 (registers the ablation schedules)

DEFAULT_SCHEDULES = ("sync", "partial", "oppo", "oppo-tis")


@dataclass(frozen=True)
class Variant:
    """What a name on --schedules runs: a schedule of integrations.launch.schedules plus flags."""

    schedule: str
    flags: tuple[str, ...] = ()


# Bench-level variants: a flag of an existing schedule, not a schedule of the product: an
# importance-sampling correction, a deferral bound of 1 (a group carried once is in the next batch),
# or a larger policy-lag bound for async admission (`oppo-async-bg-lag3`: --oppo.staleness.max_policy_lag 3).
VARIANTS = {**{f"{s}-{c}": Variant(s, ("--oppo.staleness.correction", c))
               for s in ("oppo", "oppo-async") for c in ("none", "tis", "icepop")},
            **{f"{s}-defer1": Variant(s, ("--oppo.staleness.max_deferral_steps", "1")) for s in ("oppo", "oppo-async")},
            **{f"oppo-async-bg-lag{n}": Variant("oppo-async-bg", ("--oppo.staleness.max_policy_lag", str(n)))
               for n in (3, 4)}}


def resolve(name: str) -> Variant:
    """The variant called `name` (a schedule or one of VARIANTS); ValueError naming the allowed ones."""
    if name in VARIANTS:
        return VARIANTS[name]
    if name in all_schedules():
        return Variant(name)
    raise ValueError(f"--schedules: unknown {name}; allowed: {', '.join([*all_schedules(), *VARIANTS])}")


def task_root(config_path: str) -> tuple[str, Path]:
    """(variant, assets directory) of the config's task."""
    from openrlhf_oppo import tasks
    from openrlhf_oppo.integrations.launch import yaml_config

    task = yaml_config.load(config_path).task
    variant = task.get("variant", "tiny")
    return variant, Path(task.get("assets") or tasks.default_root(variant)).expanduser()


def default_tokenizer(config_path: str) -> Path:
    """The config's task tokenizer: <task.assets or the variant's default>/tokenizer."""
    return task_root(config_path)[1] / "tokenizer"


def run_all(config: str, out: Path, schedules: list[str], seeds: list[int], variants: dict[str, Variant],
            extra: list[str], timeout_s: float | None, keep_done: bool,
            report_only: bool) -> tuple[dict[str, dict[int, dict]], int | None]:
    """Every schedule for every seed, seed-major, each in `out/<schedule>-s<seed>`: run
    (`openrlhf-oppo train` with the variant's flags and `--train.seed`), kept (`keep_done`:
    one that finished) or only read (`report_only`). Returns schedule -> seed -> result
    ({"returncode", "wall_s"}) and the bench's exit code where a signal stopped a run, else None."""
    results: dict[str, dict[int, dict]] = {s: {} for s in schedules}
    order = [(seed, name) for seed in seeds for name in schedules]
    for i, (seed, name) in enumerate(order, 1):
        root = out / f"{name}-s{seed}"
        done = json.loads((root / "result.json").read_text()) if (root / "result.json").exists() else {}
        if keep_done and done.get("returncode") == 0:
            print(f"[bench convergence] run {i}/{len(order)}: {name} seed {seed}: kept (finished in {root})",
                  flush=True)
            results[name][seed] = done
            continue
        if report_only:
            result = done
            results[name][seed] = {"returncode": result.get("returncode", 0 if (root / "tensorboard").is_dir() else 1),
                                   "wall_s": result.get("wall_s")}
            continue
        from openrlhf_oppo.integrations.launch import train_run as train

        print(f"[bench convergence] run {i}/{len(order)}: {name} seed {seed} -> {root}", flush=True)
        variant = variants[name]
        run = train.run(["--schedule", variant.schedule, "--config", config, "--output", str(root),
                         *(["--timeout-s", str(timeout_s)] if timeout_s else []),
                         "--", *extra, *variant.flags, "--train.seed", str(seed)])
        root.mkdir(parents=True, exist_ok=True)
        (root / "result.json").write_text(json.dumps({"returncode": run.returncode, "wall_s": run.wall_s}))
        results[name][seed] = {"returncode": run.returncode, "wall_s": run.wall_s}
        code = stopped("convergence", run, i, len(order), "; the same command with --keep-done runs the rest")
        if code is not None:
            return results, code
    return results, None
