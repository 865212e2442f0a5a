"""The ZeRO-3 check waits on its ranks within a bound, and ends those still running
(the check itself runs in test_zero3_integrity_on_cpu.py)."""

from __future__ import annotations

import multiprocessing
import signal
import sys
import time

from openrlhf_oppo.compat import zero3_check


def _ranks(*targets) -> list:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=args) for target, args in targets]
    for p in procs:
        p.start()
    return procs


def test_the_wait_on_the_ranks_ends_at_its_bound_and_the_ranks_are_ended():
    procs = _ranks((time.sleep, (600,)))
    try:
        start = time.monotonic()
        assert zero3_check._wait(procs, timeout_s=1.0) is False
        assert time.monotonic() - start < 30
    finally:
        zero3_check._end(procs)
    assert procs[0].exitcode == -signal.SIGTERM


def test_a_failed_rank_ends_the_wait_at_once_and_its_peer_is_ended():
    procs = _ranks((time.sleep, (600,)), (sys.exit, (3,)))
    try:
        assert zero3_check._wait(procs, timeout_s=300) is True  # not the bound: the failure
    finally:
        zero3_check._end(procs)
    assert [p.exitcode for p in procs] == [-signal.SIGTERM, 3]
