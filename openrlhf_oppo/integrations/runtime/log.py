"""Module loggers of OPPO's Ray-side code (as OpenRLHF's `init_logger`).

Messages go to the process's stdout as bare lines, as the `print`s they replaced did:
Ray forwards an actor's stdout to the driver and the run's log, and
docs/troubleshooting.md quotes the lines as they appear there.
"""

from __future__ import annotations

import logging
import sys

PACKAGE_LOGGER = "openrlhf_oppo.integrations.runtime"


class _StdoutHandler(logging.Handler):
    """Writes to `sys.stdout` as it is at the call (Ray and pytest's capture replace it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stdout.write(self.format(record) + "\n")
            sys.stdout.flush()
        except Exception:  # logging must never fail the step
            self.handleError(record)


def _package_logger() -> logging.Logger:
    root = logging.getLogger(PACKAGE_LOGGER)
    if not any(isinstance(h, _StdoutHandler) for h in root.handlers):
        handler = _StdoutHandler(logging.INFO)
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False  # a root handler Ray or a user installs would print each line twice
    return root


def get_logger(name: str) -> logging.Logger:
    """`logging.getLogger(name)` for a module under this package, its lines on stdout."""
    _package_logger()
    return logging.getLogger(name)
