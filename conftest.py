"""Test set-up shared by the product's tests (`tests/`) and the lab's (`oppo_lab/tests/`). Test
folders have no __init__.py (OpenRLHF's wheel ships a top-level `tests` package); pytest runs
with --import-mode=importlib.

No test waits forever on a build lock or outlives a SIGTERM: every process a test
starts builds DeepSpeed's ops in the project cache, as a run's processes do (not in
torch's default folder, where a killed build's lock hung a later session), this process
with the stale-lock handling (`compat.caches.use_project_cache`); and a SIGTERM ends the
session through `pytest.exit`, so the `finally` blocks on the way end what the running
test started (a run's process session, the ZeRO-3 check's ranks) before pytest exits.
"""

from __future__ import annotations

import signal

import pytest

_PREVIOUS_SIGTERM = pytest.StashKey[object]()  # the handler before this session's, restored after it


def pytest_configure(config):
    from openrlhf_oppo.compat import caches, flash_attn_standin

    caches.use_project_cache()
    # OpenRLHF's models import flash-attn at module top; where it is not installed (a CPU host, a
    # GPU host carrying only pure-Python wheels: scripts/gpu_checks.sh) the tests import its stand-in
    flash_attn_standin.install()
    config.stash[_PREVIOUS_SIGTERM] = signal.signal(signal.SIGTERM, _end_session)


def pytest_unconfigure(config):
    previous = config.stash.get(_PREVIOUS_SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _end_session(signum, frame):
    pytest.exit(f"{signal.Signals(signum).name}: the test session ends", returncode=128 + signum)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    for item in items:
        # the marker itself: `item.keywords` also holds every parent's name, so a checkout in a
        # folder named `gpu` would skip the whole suite
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)
