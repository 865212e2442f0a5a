"""ZeRO-3 loads on 2 gloo ranks return the checkpoint's weights bit for bit
(DeepSpeed 0.19.6 all-gather race on gloo). With the fix turned
off (`python -m openrlhf_oppo.compat.zero3_check DIR --unfixed`) 4 of 8 loads came
back corrupt in one of two tries on the development machine; with it, 0 of 24.

The same run shows that a build lock without a live holder hangs no op build: a test
run killed while DeepSpeed JIT-built its shared-memory op (in `init_distributed`) left
an empty `lock` in torch's default extensions folder, and the next check waited on it
for good. The ranks build in the project cache instead, where a dead holder's lock is
removed and the op built anyway (`compat.caches`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from openrlhf_oppo.compat import caches, zero3_check

pytestmark = pytest.mark.e2e  # real DeepSpeed processes (2 gloo ranks)

CHECK_TIMEOUT_S = 600.0  # 8 loads take a couple of minutes here, the op's first build about one more


def _shm_op_folder(monkeypatch, extensions_dir: str | None) -> Path:
    """The folder torch builds DeepSpeed's shared-memory op in, under TORCH_EXTENSIONS_DIR
    or, unset, under torch's default folder (`~/.cache/torch_extensions/py311_cpu/`)."""
    from deepspeed.accelerator import get_accelerator
    from torch.utils import cpp_extension

    name = get_accelerator().create_op_builder("ShareMemCommBuilder").name
    with monkeypatch.context() as m:
        if extensions_dir is None:
            m.delenv("TORCH_EXTENSIONS_DIR", raising=False)
        else:
            m.setenv("TORCH_EXTENSIONS_DIR", extensions_dir)
        return Path(cpp_extension._get_build_directory(name, verbose=False))


def _dead_holder_stamp() -> str:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return caches._stamp(proc.pid)  # its host and pid, with the start time of a process that no longer runs


def _plant(lock: Path, text: str, wait_s: float) -> bool:
    """Create `lock` as a build takes it (O_EXCL), once a build holding it now released it
    (every load of an op takes its lock a moment); False where one is still there after
    `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return True


def _holds(lock: Path, text: str) -> bool:
    try:
        return lock.read_text() == text
    except FileNotFoundError:
        return False


def test_zero3_load_keeps_every_weight_intact_and_an_ownerless_build_lock_hangs_nothing_on_cpu(tmp_path,
                                                                                               monkeypatch, capfd):
    from openrlhf_oppo.tasks import tiny

    assets = tiny.build(tmp_path / "tiny")
    default_lock = _shm_op_folder(monkeypatch, None) / "lock"
    project_lock = _shm_op_folder(monkeypatch, caches.cache_env(os.environ)["TORCH_EXTENSIONS_DIR"]) / "lock"
    stamp = _dead_holder_stamp()
    # what the killed build left: no holder recorded (one there already must not matter either)
    planted_default = _plant(default_lock, "", wait_s=0)
    try:
        # The cache held as a concurrent run holds it: the check cannot validate it (which would
        # remove the lock before the ranks start), so the ranks meet the dead holder's lock.
        with caches.in_use(os.environ, log=lambda line: None):
            assert _plant(project_lock, stamp, wait_s=300), f"{project_lock} still held after 300s"
            problems = zero3_check.check(str(assets.actor), world_size=2, loads=8, timeout_s=CHECK_TIMEOUT_S)
        dead_holders_lock_left = _holds(project_lock, stamp)
    finally:
        if _holds(project_lock, stamp):
            project_lock.unlink()
        if planted_default:
            default_lock.unlink(missing_ok=True)
    out = capfd.readouterr().out
    assert problems == []  # within CHECK_TIMEOUT_S, or a rank still running is named here
    assert not dead_holders_lock_left
    assert f"cache: removed {project_lock} (build lock of a process that is gone); building here" in out
