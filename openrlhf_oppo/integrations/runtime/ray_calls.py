"""The Ray calls of the engine pool and the reward dispatcher, in one object handed to
them, so a unit test drives both with plain objects in place of actors and refs; and the
bounded wait (`bounded_get`) every wait across processes on the GPU path goes through."""

from __future__ import annotations

from typing import Any

import ray

WEIGHT_SYNC_FLAG = "--oppo.timeouts.weight_sync_s"
ENGINE_CALL_FLAG = "--oppo.timeouts.engine_call_s"
RESUME = ("the run stops here: resume it from its last checkpoint with --ckpt.load_enable "
          "(openrlhf-oppo train --restarts N does it)")


class Stalled(RuntimeError):
    """A wait across processes ran past its bound (`--oppo.timeouts.*`): the run ends, as after a crash.
    A process blocked in a collective cannot be freed from outside; ending the driver ends them all."""


def stalled(what: str, timeout_s: float, flag: str) -> Stalled:
    """The error of a wait for `what` that ran past `timeout_s` (set by `flag`)."""
    return Stalled(f"OPPO: waited {timeout_s:g} s for {what} ({flag}); {RESUME}")


def bounded_get(calls, refs: Any, timeout_s: float, what: str, flag: str) -> Any:
    """`calls.get(refs)` within `timeout_s` seconds; past it, `Stalled` naming `what` and `flag`."""
    try:
        return calls.get(refs, timeout_s=timeout_s)
    except ray.exceptions.GetTimeoutError as exc:
        raise stalled(what, timeout_s, flag) from exc


class RayCalls:
    """`ray.get` / `ray.wait` / `ray.kill` as the pool and the dispatcher use them."""

    def get(self, refs: Any, timeout_s: float | None = None) -> Any:
        """The values of `refs`; `ray.exceptions.GetTimeoutError` past `timeout_s` (None: no bound)."""
        return ray.get(refs, timeout=timeout_s)

    def wait_any(self, refs: list, timeout_s: float | None = None) -> None:
        """Block until one of `refs` is ready, or `timeout_s` seconds passed (None: no bound)."""
        ray.wait(refs, num_returns=1, timeout=timeout_s)

    def ready(self, refs: list) -> list:
        """Those of `refs` ready now, without blocking."""
        return ray.wait(refs, num_returns=len(refs), timeout=0)[0]

    def kill(self, actor: Any, *, no_restart: bool) -> None:
        ray.kill(actor, no_restart=no_restart)
