"""The Ray calls of the engine pool and the reward dispatcher, in one object handed to
them, so a unit test drives both with plain objects in place of actors and refs."""

from __future__ import annotations

from typing import Any

import ray


class RayCalls:
    """`ray.get` / `ray.wait` / `ray.kill` as the pool and the dispatcher use them."""

    def get(self, refs: Any) -> Any:
        return ray.get(refs)

    def wait_any(self, refs: list) -> None:
        """Block until one of `refs` is ready."""
        ray.wait(refs, num_returns=1)

    def ready(self, refs: list) -> list:
        """Those of `refs` ready now, without blocking."""
        return ray.wait(refs, num_returns=len(refs), timeout=0)[0]

    def kill(self, actor: Any, *, no_restart: bool) -> None:
        ray.kill(actor, no_restart=no_restart)
