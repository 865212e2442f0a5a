"""Compile caches: where a run's caches live, and which entries are removed before it
starts (no Ray, no compiler: valid shared objects are copied from the Python install)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from openrlhf_oppo import compat
from openrlhf_oppo.compat import caches
from openrlhf_oppo.integrations.launch import launcher

KEY = "cabc2defghijklmnopqrstuvwxyz"


@pytest.fixture(scope="module")
def valid_so() -> Path:
    import _ctypes  # a compiled extension module of the interpreter itself (also inside a venv)

    found = Path(getattr(_ctypes, "__file__", ""))
    if found.suffix != ".so" or not sys.platform.startswith("linux"):
        pytest.skip("needs a Linux Python whose _ctypes is a shared object")
    return found


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return proc.pid


def _write(path: Path, data: bytes = b"") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


@pytest.fixture
def cache(tmp_path, valid_so):
    """A cache with the entries a killed run leaves (broken) next to healthy ones."""
    inductor, ext = tmp_path / "torchinductor", tmp_path / "torch_extensions" / "py311_cpu" / "ds_op"
    so_bytes = valid_so.read_bytes()
    broken = {
        _write(inductor / "ab" / "cab.main.so"): "zero-byte file",
        _write(inductor / "cd" / "ccd.main.so", so_bytes[: len(so_bytes) // 2]): "truncated ELF file",
        _write(inductor / "cd" / "ccd.main.o", so_bytes[:20]): "truncated or malformed ELF header",
        _write(inductor / "ef" / "cef.so", b"#!/bin/sh\n" * 10): "not an ELF file",
        _write(inductor / "gh" / "cgh.py"): "zero-byte file",
        _write(inductor / "ij" / f".{_dead_pid()}.140000.tmp", b"partial"): "temp file of a writer that is gone",
        _write(inductor / "kl" / "ckl.main_CxxBuild" / "x.o", so_bytes).parent: "build dir of an unfinished compile",
        _write(inductor / "precompiled_headers" / "cpch.h.gch", b"\0" * 64): "not a GCC precompiled header",
        _write(ext / "lock"): "stale build lock",
        _write(tmp_path / "vllm" / "torch_compile_cache" / "h" / "rank_0_0" / "vllm_compile_cache.py", b"{(0, 8"): (
            "unparsable vLLM compile cache index"
        ),
    }
    healthy = [
        _write(inductor / "mn" / "cmn.main.so", so_bytes),
        _write(inductor / "mn" / "cmn.main.cpp", b"int main() {}\n"),
        _write(inductor / "locks" / "cmn.lock"),  # torch's fcntl lock: released with its holder
        _write(inductor / "op" / f".{os.getpid()}.1.tmp", b"being written"),  # its writer is alive
        _write(inductor / "precompiled_headers" / "cok.h.gch", b"gpch.013" + b"\0" * 56),
        _write(ext / "ds_op.so", so_bytes),
        _write(ext / "build.ninja", b"rule cxx\n"),
        _write(tmp_path / "vllm" / "torch_compile_cache" / "h2" / "rank_0_0" / "vllm_compile_cache.py", b"{}"),
        _write(tmp_path / "vllm" / "modelinfos" / "m.json", b"{}"),
    ]
    dirs = [inductor, tmp_path / "torch_extensions", tmp_path / "vllm"]
    return dirs, broken, healthy


def test_validate_removes_exactly_the_broken_entries(cache):
    dirs, broken, healthy = cache
    lines: list[str] = []
    removed = caches.validate(dirs, log=lines.append)
    assert {r.path for r in removed} == set(broken)
    for r in removed:
        assert r.reason.startswith(broken[r.path]), (r.path, r.reason)
        assert not r.path.exists()
    assert all(path.exists() for path in healthy)
    assert len(lines) == len(broken)
    assert all(line.startswith("cache: removed ") for line in lines)
    assert any(str(next(iter(broken))) in line and "zero-byte" in line for line in lines)
    assert caches.validate(dirs, log=lines.append) == []  # a second pass finds nothing


def test_a_kernel_being_compiled_is_left_alone(tmp_path):
    so = _write(tmp_path / "ab" / f"{KEY}.main.so")
    lock = _write(tmp_path / "locks" / f"{KEY}.lock")
    with open(lock, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # what torch's FileLock holds while it compiles
        assert caches.validate([tmp_path], log=lambda _: None) == []
        assert so.exists()
    assert [r.path for r in caches.validate([tmp_path], log=lambda _: None)] == [so]


def test_cache_env_puts_every_cache_under_the_project_cache_and_a_user_value_wins(tmp_path):
    env = caches.cache_env({}, root=tmp_path)
    assert env == {var: str(tmp_path / name) for var, name in caches.CACHE_VARS.items()}
    user = caches.cache_env({"TRITON_CACHE_DIR": "/mine/triton"}, root=tmp_path)
    assert user["TRITON_CACHE_DIR"] == "/mine/triton"
    assert user["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "torchinductor")


def test_torch_default_inductor_dir_is_not_taken_for_a_user_choice(tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    env = caches.cache_env({"TORCHINDUCTOR_CACHE_DIR": default_cache_dir()}, root=tmp_path)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "torchinductor")


@pytest.mark.parametrize("cuda", [False, True])
def test_child_env_sets_the_cache_variables_on_any_hardware(tmp_path, monkeypatch, cuda):
    monkeypatch.setattr(caches, "CACHE_DIR", tmp_path)
    if cuda:
        monkeypatch.setattr(compat, "launch_env", lambda base: {})  # what it returns where CUDA is present
    for var in caches.CACHE_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/mine/ext")
    env = launcher.child_env(launcher.RunPaths(tmp_path / "run"), {}, None)
    assert env["TORCH_EXTENSIONS_DIR"] == "/mine/ext"
    for var, name in caches.CACHE_VARS.items():
        if var != "TORCH_EXTENSIONS_DIR":
            assert env[var] == str(tmp_path / name)
    assert caches.cache_dirs(env, tmp_path) == [(tmp_path / n).resolve() for n in ("torchinductor", "triton", "vllm")]


def test_in_use_validates_only_while_no_other_run_holds_the_cache(tmp_path):
    env = caches.cache_env({}, root=tmp_path)
    zero = _write(tmp_path / "torchinductor" / "ab" / "cab.main.so")
    lines: list[str] = []
    with caches.in_use(env, root=tmp_path, log=lines.append):
        with caches.in_use(env, root=tmp_path, log=lines.append):  # a second run meanwhile
            pass
    assert lines[0] == f"cache: removed {zero} (zero-byte file)"
    assert lines[1].startswith("cache: not validated, another run is using")
    _write(zero)
    with caches.in_use(env, root=tmp_path, log=lines.append):  # the first run released it
        assert not zero.exists()


def test_a_build_lock_names_its_holder_and_is_stale_only_when_that_process_is_gone(tmp_path):
    import socket

    mine = _write(tmp_path / "mine" / "lock", caches._stamp(os.getpid()).encode())
    assert not caches.baton_holder_gone(mine)
    dead = _write(tmp_path / "dead" / "lock", caches._stamp(_dead_pid()).encode())
    assert caches.baton_holder_gone(dead)
    host, pid, started = caches._stamp(os.getpid()).split()
    # same pid, another process
    reused = _write(tmp_path / "reused" / "lock", f"{host} {pid} {int(started) + 1}".encode())
    assert caches.baton_holder_gone(reused)
    elsewhere = _write(tmp_path / "other" / "lock", f"{socket.gethostname()}-other {_dead_pid()} 1".encode())
    assert not caches.baton_holder_gone(elsewhere)  # another host's process: cannot be judged here
    assert not caches.baton_holder_gone(_write(tmp_path / "unstamped" / "lock"))  # torch's own lock: waited on


_BUILD = r"""
import sys, torch.utils.cpp_extension as cpp
from openrlhf_oppo.compat import caches
if sys.argv[1] == "patched":
    caches.stamp_build_batons(cpp)
if sys.argv[2] == "hold":  # take the build lock as a build does, then die holding it
    import os, signal
    assert cpp.FileBaton(os.path.join(sys.argv[3], "lock")).try_acquire()
    os.kill(os.getpid(), signal.SIGKILL)
cpp.load("oppo_baton_probe", [sys.argv[4]], build_directory=sys.argv[3], is_python_module=False)
print("built")
"""


@pytest.mark.parametrize("waiter", ["patched", "torch"])
def test_a_build_killed_holding_its_lock_does_not_hang_the_next_build(tmp_path, waiter):
    """torch's cpp_extension waits forever on the lock file a killed build leaves (seen:
    a DeepSpeed op build hung in `FileBaton.wait`); with the stamp the next build takes over."""
    build = tmp_path / "build"
    build.mkdir()
    source = _write(tmp_path / "probe.cpp", b"extern \"C\" int oppo_baton_probe() { return 1; }\n")
    script = _write(tmp_path / "build.py", _BUILD.encode())
    env = {**os.environ, "MAX_JOBS": "1"}
    holder = subprocess.run([sys.executable, str(script), "patched", "hold", str(build), str(source)], env=env,
                            timeout=120)
    assert holder.returncode == -9 and (build / "lock").exists()
    try:
        out = subprocess.run([sys.executable, str(script), waiter, "build", str(build), str(source)], env=env,
                             capture_output=True, text=True, timeout=60 if waiter == "patched" else 10)
    except subprocess.TimeoutExpired:
        assert waiter == "torch", "the patched waiter hung on a dead holder's build lock"
        return
    assert waiter == "patched", f"torch's own waiter did not hang: {out.stdout}{out.stderr}"
    assert out.returncode == 0, out.stderr
    assert "building here" in out.stdout and out.stdout.rstrip().endswith("built")
    assert not (build / "lock").exists() and (build / "oppo_baton_probe.so").exists()


def test_use_project_cache_points_every_cache_at_the_project_cache_and_keeps_a_users_value(tmp_path):
    environ = {"TRITON_CACHE_DIR": "/mine/triton", "PATH": "/bin"}
    caches.use_project_cache(environ, root=tmp_path)
    expected = {var: str(tmp_path / name) for var, name in caches.CACHE_VARS.items()}
    assert environ == {**expected, "TRITON_CACHE_DIR": "/mine/triton", "PATH": "/bin"}


def test_the_test_session_and_every_process_it_starts_build_in_the_project_cache_with_stamped_locks():
    """tests/conftest.py: not in torch's default folder, where a killed build's lock hangs
    every later build of that op."""
    from torch.utils import cpp_extension

    extensions = os.environ["TORCH_EXTENSIONS_DIR"]
    assert not Path(extensions).resolve().is_relative_to(Path(cpp_extension.get_default_build_root()).resolve())
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ['TORCH_EXTENSIONS_DIR'])"],
                           capture_output=True, text=True, timeout=60)
    assert child.stdout.strip() == extensions
    assert cpp_extension.FileBaton.wait.__qualname__ == "stamp_build_batons.<locals>.wait"


def _fake_cpp_extension(build_dir: Path):
    """torch 2.13 `cpp_extension` as far as its build lock goes: `_jit_compile` takes the
    lock and builds, or waits while another process holds it (then loads that build)."""
    import types

    from torch.utils.file_baton import FileBaton as TorchBaton

    class FileBaton(TorchBaton):  # the patch sets its methods here, torch's class stays as it is
        pass

    built: list[str] = []

    def _jit_compile(name: str) -> None:
        baton = FileBaton(str(build_dir / "lock"), wait_seconds=0.01)
        if baton.try_acquire():
            try:
                built.append(name)
            finally:
                baton.release()
        else:
            baton.wait()

    versioner = types.SimpleNamespace(entries={})
    return types.SimpleNamespace(FileBaton=FileBaton, _jit_compile=_jit_compile, JIT_EXTENSION_VERSIONER=versioner,
                                 built=built)


def test_a_build_waiting_on_a_dead_holders_lock_removes_it_and_builds(tmp_path, capsys):
    cpp = _fake_cpp_extension(tmp_path)
    caches.stamp_build_batons(cpp, lock_wait_s=60)
    lock = _write(tmp_path / "lock", caches._stamp(_dead_pid()).encode())
    cpp._jit_compile("op")
    assert cpp.built == ["op"] and not lock.exists()
    assert f"cache: removed {lock} (build lock of a process that is gone); building here" in capsys.readouterr().out


def test_a_build_waiting_on_a_lock_with_no_holder_recorded_ends_with_an_error_naming_it(tmp_path):
    cpp = _fake_cpp_extension(tmp_path)
    caches.stamp_build_batons(cpp, lock_wait_s=0.2)
    lock = _write(tmp_path / "lock")  # torch's own lock, left by a build killed mid-way
    with pytest.raises(TimeoutError, match=f"build lock {lock} \\(no holder recorded\\); if no build"):
        cpp._jit_compile("op")
    assert cpp.built == [] and lock.exists()  # whose it is cannot be told: left for `validate` or the user


def test_a_build_waits_past_the_bound_while_the_lock_holder_runs(tmp_path):
    import threading

    cpp = _fake_cpp_extension(tmp_path)
    caches.stamp_build_batons(cpp, lock_wait_s=0.05)
    lock = _write(tmp_path / "lock", caches._stamp(os.getpid()).encode())  # a holder that is building
    holder_done = threading.Timer(0.5, lock.unlink)
    holder_done.start()
    try:
        cpp._jit_compile("op")  # returns once the holder released its lock (torch then loads its build)
    finally:
        holder_done.join(10)
    assert cpp.built == [] and not lock.exists()
