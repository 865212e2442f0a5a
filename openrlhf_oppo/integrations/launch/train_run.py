"""`openrlhf-oppo train --schedule sync --config configs/tiny-cpu.yaml [-- extra OpenRLHF flags]`

Translates the YAML into OpenRLHF 0.11.2's own dotted flags, adds the schedule's
flags (see openrlhf_oppo.integrations.launch.schedules) and runs OpenRLHF's
`train_ppo_ray` unmodified, with the CPU compat layer where CUDA is absent.
Progress and metrics are OpenRLHF's (stdout, TensorBoard under <output>/tensorboard,
wandb offline when configured without a key). `--dry-run` runs every check the launch runs
(flags, the memory of every GPU per phase, the inputs) and prints the command, starting
nothing.
"""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from openrlhf_oppo.integrations.launch.schedules import all_schedules
from openrlhf_oppo.integrations.launch.yaml_config import to_argv


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="openrlhf-oppo train", description=__doc__.splitlines()[0])
    p.add_argument("--schedule", required=True,
                   help=f"one of: {', '.join(all_schedules())}. oppo where vLLM shares the GPUs with training "
                        "(colocated, the hybrid engine) and on one CPU machine; oppo-async-bg where vLLM has GPUs of "
                        "its own (--train.colocate_all --train.async_enable); sync, async, partial, oversample: "
                        "OpenRLHF's own modes, the baselines (README, Schedules)")
    p.add_argument("--config", required=True, help="YAML run config, e.g. configs/tiny-cpu.yaml")
    p.add_argument("--assets", default=None,
                   help="task assets dir (default: task.assets or ~/.cache/openrlhf_oppo/<task.variant>)")
    p.add_argument("--output", default=None, help="run directory (default: runs/<config>-<schedule>)")
    p.add_argument("--timeout-s", type=float, default=None, help="end the run (exit 124) after this many seconds")
    p.add_argument("--skip-input-checks", action="store_true",
                   help="skip the dataset, prompt-length and tokenizer checks before launch (flag checks still run)")
    p.add_argument("--restarts", type=int, default=0,
                   help="after a crash, relaunch this many times from the last checkpoint (--ckpt.load_enable; "
                        "set --ckpt.save_steps). A stop asked by SIGTERM/SIGINT or --timeout-s is not restarted")
    p.add_argument("--verbose", action="store_true",
                   help="show Ray's, vLLM's and OpenRLHF's output here too (it always goes to RUN_DIR/train.log)")
    p.add_argument("--dry-run", action="store_true",
                   help="run every check the launch runs (flags, the memory table of every GPU per phase, the "
                        "inputs), print the command and exit without starting Ray or vLLM: 0 when everything "
                        "passes, 2 with the refusal (a model the memory check cannot count included)")
    p.add_argument("--help-openrlhf", action="store_true", help="list OpenRLHF's flags with their defaults and exit")
    p.add_argument("extra", nargs="*", help="after `--`: extra OpenRLHF flags, passed verbatim")
    return p


def _task_flags(flags: dict, assets_dir: str | None, variant: str) -> tuple[dict, Path | None]:
    """Model and data paths default to a built-in task (`variant`, one of
    openrlhf_oppo.tasks.VARIANTS), built on first use."""
    from openrlhf_oppo import tasks

    # Checked even when the paths are given, so a typo never passes silently.
    if variant not in tasks.VARIANTS:
        raise ValueError(f"task.variant: unknown variant '{variant}'; allowed: {', '.join(tasks.VARIANTS)}")
    needed = {"actor.model_name_or_path", "data.prompt_dataset"}
    if not flags.get("reward.remote_url"):  # a rule-based or remote reward needs no reward model
        needed.add("reward.model_name_or_path")
    if needed <= flags.keys():
        return {}, None
    assets = tasks.build(variant, assets_dir)
    defaults = {
        "actor.model_name_or_path": str(assets.actor),
        "reward.model_name_or_path": str(assets.reward),
        "critic.model_name_or_path": str(assets.critic),
        "data.prompt_dataset": str(assets.prompts),
    }
    return {k: v for k, v in defaults.items() if k not in flags}, assets.actor / "tokenizer.json"


@dataclass(frozen=True)
class _Plan:
    """What a run launches: OpenRLHF's flags, the argv after them, and whether OPPO runs."""

    flags: dict  # dotted OpenRLHF flags: the YAML's, the task's model and data paths, the schedule's
    extra: list[str]  # `--oppo.*` flags (OPPO schedules), then the user's extra flags
    oppo: bool  # an OPPO schedule (entry point openrlhf_oppo.cli.train_ppo_ray)
    tokenizer_json: Path | None  # the built-in task's tokenizer, for the weight-sync probe
    env: dict[str, str]  # OPPO_* settings of the run's processes beyond the launcher's own


def _plan(args: argparse.Namespace) -> _Plan:
    """Every flag check, before anything is built or started; then the task's defaults."""
    from openrlhf_oppo import run_env
    from openrlhf_oppo.integrations.launch import memory_check, preflight, schedules, yaml_config
    from openrlhf_oppo.integrations.runtime import fixed_lengths

    config = yaml_config.load(args.config)
    oppo_cfg = schedules.oppo_config(args.schedule, config.oppo)  # validated before any work
    flags = dict(config.flags)
    oppo_argv: list[str] = []
    if oppo_cfg is not None:
        from openrlhf_oppo.config import fit_delta, to_cli_args
        from openrlhf_oppo.integrations.launch import driver

        openrlhf_argv = [*yaml_config.to_argv(flags), *args.extra]
        section = schedules.merged_oppo(args.schedule, config.oppo)  # the YAML's `oppo:` and the schedule's
        # the user's `--oppo.*` flags on the schedule's, as the child's driver reads them: check what it will run
        oppo_cfg, note = fit_delta(driver.overlay_flags(args.extra, oppo_cfg), driver.rollout_batch(openrlhf_argv),
                                   driver.delta_given(section, args.extra))
        if note:
            print(f"openrlhf-oppo train: {note}", flush=True)
        driver.check_flags(openrlhf_argv, oppo_cfg)
        oppo_argv = to_cli_args(oppo_cfg)
    extra = [*oppo_argv, *args.extra]
    device = memory_check.preset_device(config.device, args.config)
    # before anything is built or started
    preflight.check_config(flags, extra, oppo=oppo_cfg is not None, device=device, strict_memory=args.dry_run)
    task_defaults, tokenizer_json = _task_flags(
        flags, args.assets or config.task.get("assets"), config.task.get("variant", "tiny")
    )
    flags.update(task_defaults)
    flags.update(schedules.schedule_flags(args.schedule, flags))
    env = {}
    lengths = fixed_lengths.from_config(config.task, flags)
    if lengths is not None:
        env[run_env.FIXED_LENGTHS] = lengths.to_env()
        print(f"openrlhf-oppo train: response lengths fixed per sample (task.fixed_lengths): log-normal, median "
              f"{lengths.median_tokens:g}, sigma {lengths.sigma:g}, at most {flags['rollout.max_new_tokens']} tokens; "
              f"the same in every schedule", flush=True)
    return _Plan(flags=flags, extra=extra, oppo=oppo_cfg is not None, tokenizer_json=tokenizer_json, env=env)


def parse_args(argv: list[str]) -> argparse.Namespace:
    return _parser().parse_args(argv)


def run(argv: list[str]):
    """One `openrlhf-oppo train` run from its argv: the launcher's RunResult (exit code, wall time, run paths)."""
    args = parse_args(argv)
    if args.dry_run:
        raise ValueError("--dry-run: use train_run.dry_run (this launches)")
    from openrlhf_oppo.integrations.launch import launcher

    schedule, plan, paths = _checked(args)
    probe_ids = launcher.probe_prompt_ids(plan.tokenizer_json) if plan.tokenizer_json else None
    result = _launch(args, plan, paths, probe_ids, schedule.entry_module)
    _report(args.schedule, result)
    return result


def dry_run(args: argparse.Namespace) -> int:
    """`--dry-run`: every check `run` makes before it launches (a refusal is a ValueError), then
    the command it would launch; nothing is started. 0."""
    from openrlhf_oppo.integrations.launch import launcher

    schedule, plan, paths = _checked(args)
    argv = ["python", "-m", schedule.entry_module, *to_argv(launcher.run_flags(paths, plan.flags)), *plan.extra]
    print("openrlhf-oppo train: dry run: every check passed; nothing started. It would launch:", flush=True)
    print("  " + " ".join(shlex.quote(a) for a in argv), flush=True)
    return 0


def _checked(args: argparse.Namespace):
    """(schedule, plan, run paths) after every check a launch makes: flags, memory, inputs."""
    from openrlhf_oppo.integrations.launch import launcher, preflight, schedules

    schedule = schedules.check(args.schedule)
    plan = _plan(args)
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(args.config).stem)
    paths = launcher.RunPaths(Path(args.output or f"runs/{stem}-{args.schedule}").resolve())
    _check_writable(paths.root, "--output")
    for name in ("ckpt.path", "ckpt.output_dir", "logger.tensorboard_dir"):  # where the config moves an output
        if name in plan.flags:
            _check_writable(Path(str(plan.flags[name])).resolve(), f"--{name}")
    preflight.check_checkpoint(preflight.resolve(launcher.run_flags(paths, plan.flags), plan.extra, plan.oppo)[0])
    if args.skip_input_checks:
        paths.preflight.unlink(missing_ok=True)
        print("openrlhf-oppo train: input checks skipped (--skip-input-checks)", flush=True)
    else:
        preflight.check_inputs(plan.flags, plan.extra, paths.preflight, oppo=plan.oppo)
    if args.restarts < 0:
        raise ValueError(f"--restarts must be >= 0, got {args.restarts}")
    return schedule, plan, paths


def _check_writable(folder: Path, flag: str) -> None:
    """ValueError naming `flag` unless a file can be made in `folder` (made where missing)."""
    import tempfile

    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ValueError(f"{flag} {folder}: cannot write there ({exc.strerror}); name a writable folder") from None


def _launch(args: argparse.Namespace, plan: _Plan, paths, probe_ids: list[int] | None, entry_module: str):
    """Launch, and after a crash relaunch from the last checkpoint up to `--restarts` times."""
    from openrlhf_oppo.integrations.launch import launcher

    extra = plan.extra
    for attempt in range(args.restarts + 1):
        result = launcher.launch(
            plan.flags, paths, extra, probe_ids, timeout_s=args.timeout_s,
            entry_module=entry_module, fresh=attempt == 0, graceful_stop=plan.oppo, verbose=args.verbose,
            env=plan.env,
        )
        if result.returncode in (0, launcher.TIMEOUT_RETURNCODE) or result.stopped_by or attempt == args.restarts:
            break
        print(f"openrlhf-oppo train: exit {result.returncode}; restart {attempt + 1} of {args.restarts} from the "
              f"last checkpoint in {plan.flags.get('ckpt.path', paths.checkpoints)} (the ledger spans the attempts)",
              flush=True)
        if "--ckpt.load_enable" not in extra:
            extra = [*extra, "--ckpt.load_enable"]
    return result


def _report(schedule: str, result) -> None:
    from openrlhf_oppo.integrations.launch import launcher

    paths = result.paths
    probes = launcher.read_probe(paths.sync_probe)
    changed = sum(1 for a, b in zip(probes, probes[1:], strict=False) if a["logprobs"] != b["logprobs"])
    print(
        f"openrlhf-oppo train: schedule={schedule} exit={result.returncode} wall={result.wall_s:.1f}s "
        f"weight_syncs={len(probes)} vllm_output_changed_after={changed}/{max(len(probes) - 1, 0)} "
        f"output={paths.root}",
        flush=True,
    )
