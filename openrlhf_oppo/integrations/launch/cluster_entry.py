"""`python -m openrlhf_oppo.cli.train_ppo_ray`'s main: what `ray job submit` runs.

Everything is checked before Ray starts, as `openrlhf-oppo train` checks it: the flags
(`driver.resolve`: OPPO's refusals), the batch and length set-up (`preflight.check_config`)
and the inputs (`preflight.check_inputs`: every row of the local dataset files, prompts
against OpenRLHF's prompt budget, the reward model's and critic's tokenizers against the
actor's). A bad row is an error naming the file and row here, not deep inside an actor after
the cluster has started. Hub ids are skipped with a notice, as in `openrlhf-oppo train`.
`--dry-run` runs these checks, prints the memory table and exits without starting Ray
(0, or 2 with the refusal; a model the memory check cannot count is a refusal there).

Once Ray is up, the driver says whether the site hook runs in the workers of every node (it forwards
a PYTHONPATH with the hook's folder first, merged with the user's: `worker_hooks`), and ends the run
here, before OpenRLHF starts, when something the run asks for (length-bucketed micro-batches, on by
default) needs it on a node where it is not.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from openrlhf_oppo import run_env
from openrlhf_oppo.integrations.launch import driver, openrlhf_flags, preflight, worker_hooks

REPORT_ENV = "OPPO_PREFLIGHT_JSON"  # where the input checks' report goes (default: a temp file)


def _report_path() -> Path:
    named = os.environ.get(REPORT_ENV)
    if named:
        return Path(named)
    return Path(tempfile.gettempdir()) / f"openrlhf_oppo-preflight-{os.getpid()}.json"


DRY_RUN = "--dry-run"  # every check, then exit: no Ray, no vLLM


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if openrlhf_flags.asks_help(argv):
        print(openrlhf_flags.format_help())
        return 0
    if "-h" in argv or "--help" in argv:
        driver.print_help()
        return 0
    dry_run = DRY_RUN in argv
    argv = [a for a in argv if a != DRY_RUN]
    try:
        preflight.resolve({}, argv, oppo=True)  # a misspelt flag first, before what it would have set is missed
        cfg, rest = driver.resolve(argv)
        preflight.check_checkpoint(preflight.check_config({}, argv, oppo=True, strict_memory=dry_run))
        if os.environ.get(run_env.SKIP_INPUT_CHECKS, "") not in ("1", "true"):  # the flags' checks stay
            preflight.check_inputs({}, argv, _report_path(), oppo=True)
    except (ValueError, FileNotFoundError) as exc:
        print(f"{driver.ENTRY_MODULE}: error: {exc}", file=sys.stderr)
        return 2
    if dry_run:
        print(f"{driver.ENTRY_MODULE}: dry run: every check passed; Ray not started", flush=True)
        return 0
    try:
        driver.run_openrlhf(cfg, rest)
    except worker_hooks.SiteHookMissing as exc:
        print(f"{driver.ENTRY_MODULE}: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        stop = _stop_request(exc)
        if stop is None:
            raise
        print(stop, file=sys.stderr, flush=True)  # one line: the step, the checkpoint, how to resume
        return STOPPED
    return 0


STOPPED = 3  # the run stopped on request (OPPO_STOP_FILE: the launcher's SIGINT/SIGTERM) after a checkpoint


def _stop_request(exc: BaseException) -> str | None:
    """The trainer's StopRequested message behind the error `ray.get` raised in the driver, or None."""
    from openrlhf_oppo.integrations.runtime.trainer import StopRequested

    cause = getattr(exc, "cause", exc)  # a RayTaskError holds the actor's exception as its cause
    return str(cause) if isinstance(cause, StopRequested) else None
