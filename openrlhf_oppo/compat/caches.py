"""Compile caches of a run: where they live, and what is removed before a run starts.

TorchInductor, Triton, DeepSpeed's JIT-built ops (`torch.utils.cpp_extension`) and
vLLM's compile cache live in a per-user project cache (`CACHE_DIR`), not in the
shared system temp dir, and every process of a run gets the variables (`cache_env`).
A process that starts op-building processes itself, not through `openrlhf-oppo train`
(the ZeRO-3 check, the test session), calls `use_project_cache` first, and each
worker it starts calls it again.

TorchInductor links a kernel straight to its final path (`g++ ... -o <key>.main.so`)
and later trusts any file at that path, so a run ended mid-compile can leave a
zero-byte or truncated `.so` that breaks every later run needing that kernel.
`in_use` (called by the launcher) removes such entries first (`validate`), while no
other run uses the cache, and holds the cache for the run.

torch's `cpp_extension` (DeepSpeed's JIT-built ops) serialises builds with a lock file
that records no owner and is waited on forever, so a build killed mid-way hangs every
later build of that op, even one already waiting. `stamp_build_batons` (installed in
every process of a run) stamps the holder into the file, and a waiter that finds the
holder gone removes the lock and builds the op itself; a lock whose holder cannot be
judged here (no stamp, or another host's) ends the wait after `BUILD_LOCK_WAIT_S`
with an error naming the file.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import functools
import os
import re
import shutil
import socket
import struct
import sys
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

from openrlhf_oppo.compat.env import CACHE_DIR
from openrlhf_oppo.compat.patches import TORCH_VERSION
from openrlhf_oppo.hooks import Patch, install_hooks

# variable -> folder under the project cache
CACHE_VARS = {
    "TORCHINDUCTOR_CACHE_DIR": "torchinductor",
    "TRITON_CACHE_DIR": "triton",
    "TORCH_EXTENSIONS_DIR": "torch_extensions",  # DeepSpeed's JIT-built CPU ops
    "VLLM_CACHE_ROOT": "vllm",  # torch_compile_cache/ (redirects Inductor and Triton there)
}
RUN_LOCK = "run.lock"  # shared while a run uses the cache, exclusive while validating

_ELF_SUFFIXES = (".so", ".o")
_TMP_FILE = re.compile(r"\.(\d+)(?:\.\d+)?\.tmp$")  # Inductor `.{pid}.{tid}.tmp`, vLLM `<file>.{pid}.tmp`
_TMP_DIR = re.compile(r"^tmp\.pid_(\d+)_")  # Triton's `tmp.pid_{pid}_{uuid}` staging dirs
_BUILD_DIR_SUFFIX = "_CxxBuild"  # Inductor's per-kernel compile cwd, removed after a finished build
_BATON = "lock"  # torch.utils.file_baton: cpp_extension builds wait while this file exists
# How long a build waits on a lock whose holder cannot be judged here (no stamp: a writer
# without `stamp_build_batons`; or another host's): longer than any op build takes.
BUILD_LOCK_WAIT_S = 1800.0


@dataclass(frozen=True)
class Removed:
    path: Path
    reason: str


def cache_env(base: Mapping[str, str], root: Path | None = None) -> dict[str, str]:
    """The cache variables for every process of a run; a value set in `base` wins,
    except TorchInductor's default temp dir, which torch writes into `os.environ`
    itself (so its presence does not mean anyone chose it)."""
    root = CACHE_DIR if root is None else Path(root)
    env = {var: str(root / name) for var, name in CACHE_VARS.items()}
    for var in CACHE_VARS:
        value = base.get(var)
        if value and not (var == "TORCHINDUCTOR_CACHE_DIR" and _is_inductor_default(value)):
            env[var] = value
    return env


def use_project_cache(environ: MutableMapping[str, str] | None = None, root: Path | None = None) -> None:
    """Op builds of this process, and of every process it starts from now on, go to the
    project cache (`cache_env` into `environ`, default this process's environment) and
    this process builds with the stale-lock handling (`stamp_build_batons`, installed
    here: a worker the caller starts calls this function itself, before DeepSpeed builds
    anything). What `openrlhf-oppo train` gives every process of a run, for a process
    that starts its workers itself. Idempotent."""
    environ = os.environ if environ is None else environ
    environ.update(cache_env(environ, root))
    install_hooks(PATCHES)


def cache_dirs(env: Mapping[str, str], root: Path | None = None) -> list[Path]:
    """The run's cache dirs that `validate` may clean: those inside the project cache
    (a dir the user named elsewhere is left as it is)."""
    root = (CACHE_DIR if root is None else Path(root)).resolve()
    dirs = []
    for var in CACHE_VARS:
        if env.get(var):
            path = Path(env[var]).resolve()
            if path.is_relative_to(root) and path not in dirs:
                dirs.append(path)
    return dirs


@contextlib.contextmanager
def in_use(env: Mapping[str, str], root: Path | None = None, log: Callable[[str], None] = print) -> Iterator[None]:
    """Validate the run's cache dirs unless another run is using the cache, then hold
    the cache (shared) until the block ends."""
    root = CACHE_DIR if root is None else Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / RUN_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        log(f"cache: not validated ({root / RUN_LOCK}: {e.strerror})")
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"cache: not validated, another run is using {root}")
        else:
            validate(cache_dirs(env, root), log)
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def validate(dirs: list[Path], log: Callable[[str], None] = print) -> list[Removed]:
    """Remove the entries of `dirs` that an interrupted writer leaves broken:
    zero-byte files, `.so` / `.o` files that are not whole ELF files, `.gch` files that
    are not precompiled headers, an unparsable `vllm_compile_cache.py`, temp files and
    dirs of writers that are gone, and stale `cpp_extension` build batons. One log
    line per removed entry. Stat-based; reads only headers (and vLLM's small index)."""
    removed = []
    for root in dirs:
        if root.is_dir():
            for path, reason in _broken(root):
                try:
                    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
                except FileNotFoundError:
                    continue
                except OSError as e:
                    log(f"cache: could not remove {path} ({reason}): {e.strerror}")
                    continue
                log(f"cache: removed {path} ({reason})")
                removed.append(Removed(path, reason))
    return removed


def _broken(root: Path) -> Iterator[tuple[Path, str]]:
    stack = [root]
    while stack:
        try:
            with os.scandir(stack.pop()) as entries:
                entries = list(entries)
        except OSError:
            continue
        for entry in entries:
            path = Path(entry.path)
            if entry.is_dir(follow_symlinks=False):
                reason = _broken_dir(path)
                if reason:
                    yield path, reason
                else:
                    stack.append(path)
            elif entry.is_file(follow_symlinks=False):
                try:
                    size = entry.stat(follow_symlinks=False).st_size
                except OSError:
                    continue
                reason = _broken_file(path, size)
                if reason and not _compile_in_progress(path):
                    yield path, reason


def _broken_dir(path: Path) -> str | None:
    if m := _TMP_DIR.match(path.name):
        return None if _pid_alive(int(m.group(1))) else f"temp dir of a writer that is gone (pid {m.group(1)})"
    if path.name.endswith(_BUILD_DIR_SUFFIX) and not _compile_in_progress(path):
        return "build dir of an unfinished compile"
    return None


class StaleBuildLock(RuntimeError):
    """A build lock's holder is gone (removed by the waiter, which builds instead)."""


def stamp_build_batons(cpp_extension, lock_wait_s: float = BUILD_LOCK_WAIT_S) -> None:
    """torch 2.13 `torch.utils.cpp_extension`: `_jit_compile` takes a `FileBaton` lock
    file (O_EXCL) to build, and other processes `wait` while it exists, forever. Here
    the holder's stamp (host, pid, process start time) is written into the file; a
    waiter that finds the holder gone removes the lock and builds the op itself
    (`_jit_compile` again). A lock whose holder cannot be judged (unstamped: a writer
    without this patch; or another host's) is waited on for `lock_wait_s`, then the
    build fails with a `TimeoutError` naming the file (`validate` removes an unstamped
    one before the next run)."""
    cls = cpp_extension.FileBaton
    original_acquire, original_compile = cls.try_acquire, cpp_extension._jit_compile

    def try_acquire(self) -> bool | None:
        acquired = original_acquire(self)
        if acquired:
            with contextlib.suppress(OSError):
                fd = os.open(self.lock_file_path, os.O_WRONLY)
                try:
                    os.write(fd, _stamp(os.getpid()).encode())
                finally:
                    os.close(fd)
        return acquired

    def wait(self) -> None:
        deadline = time.monotonic() + lock_wait_s
        while os.path.exists(self.lock_file_path):
            lock = Path(self.lock_file_path)
            if baton_holder_gone(lock):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(lock)
                raise StaleBuildLock(lock)
            if time.monotonic() > deadline and not _holder_alive_here(lock):
                holder = _head(lock, 512).decode(errors="replace").strip() or "no holder recorded"
                raise TimeoutError(f"waited {lock_wait_s:.0f}s for the build lock {lock} ({holder}); if no build "
                                   "of this op is running, remove the file")
            time.sleep(self.wait_seconds)

    @functools.wraps(original_compile)
    def _jit_compile(*args, **kwargs):
        while True:
            try:
                return original_compile(*args, **kwargs)
            except StaleBuildLock as stale:
                print(f"cache: removed {stale} (build lock of a process that is gone); building here", flush=True)
                # the first attempt recorded the op's version as current: forget it, or nothing is built
                cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(args[0] if args else kwargs["name"], None)

    cls.try_acquire, cls.wait = try_acquire, wait
    cpp_extension._jit_compile = _jit_compile


# Not a CPU workaround: installed in every process of a run, on any hardware
# (integrations.runtime.startup).
PATCHES: tuple[Patch, ...] = (
    Patch("stamped_build_batons", "torch.utils.cpp_extension", stamp_build_batons, f"torch {TORCH_VERSION}"),
)


def baton_holder_gone(lock: Path) -> bool:
    """Whether `lock` carries the stamp of a process on this host that no longer runs
    (a pid reused since has another start time). False for unstamped locks and locks
    held on other hosts (a cache on a shared file system)."""
    holder = _holder(lock)
    if holder is None or holder[0] != socket.gethostname():
        return False
    host, pid, started = holder
    return not _pid_alive(pid) or _stamp(pid) != f"{host} {pid} {started}"


def _holder_alive_here(lock: Path) -> bool:
    """Whether `lock` carries the stamp of a process on this host that still runs (its
    build goes on: waited on without a bound, its end or death ends the wait)."""
    holder = _holder(lock)
    return holder is not None and holder[0] == socket.gethostname() and not baton_holder_gone(lock)


def _holder(lock: Path) -> tuple[str, int, str] | None:
    """The stamp in `lock`: (host, pid, start time); None where it holds none."""
    try:
        host, pid, started = _head(lock, 512).decode().split()
        return host, int(pid), started
    except ValueError:
        return None


def _stamp(pid: int) -> str:
    """`host pid start-time`: the start time (clock ticks since boot, /proc/<pid>/stat
    field 22) tells a reused pid apart; "0" where /proc is absent."""
    started = "0"
    with contextlib.suppress(OSError, IndexError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        started = stat[stat.rindex(")") + 2:].split()[19]
    return f"{socket.gethostname()} {pid} {started}"


def _broken_file(path: Path, size: int) -> str | None:
    name = path.name
    if m := _TMP_FILE.search(name):
        return None if _pid_alive(int(m.group(1))) else f"temp file of a writer that is gone (pid {m.group(1)})"
    if name == _BATON:
        return "stale build lock (no run is building)"
    if name.endswith(".lock"):
        return None  # fcntl locks (torch's FileLock): the kernel releases them with their holder
    if size == 0:
        return "zero-byte file"
    if name.endswith(_ELF_SUFFIXES) and sys.platform.startswith("linux"):
        return _elf_problem(path, size)
    if name.endswith(".gch"):
        return None if _head(path, 4) == b"gpch" else "not a GCC precompiled header"
    if name == "vllm_compile_cache.py":
        try:
            ast.literal_eval(path.read_text())
        except (OSError, ValueError, SyntaxError, UnicodeDecodeError):
            return "unparsable vLLM compile cache index"
    return None


def _elf_problem(path: Path, size: int) -> str | None:
    """Why `path` is not a whole ELF file (header and header tables inside the file)."""
    head = _head(path, 64)
    if head[:4] != b"\x7fELF":
        return "not an ELF file"
    order = {1: "<", 2: ">"}.get(head[5] if len(head) > 5 else 0)
    if head[4:5] == b"\x02" and order and len(head) >= 64:
        phoff, shoff = struct.unpack_from(order + "QQ", head, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 0x36)
    elif head[4:5] == b"\x01" and order and len(head) >= 52:
        phoff, shoff = struct.unpack_from(order + "II", head, 0x1C)
        phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 0x2A)
    else:
        return "truncated or malformed ELF header"
    end = max(phoff + phnum * phentsize, shoff + shnum * shentsize)
    if size < end:
        return f"truncated ELF file ({size} bytes, its header tables end at {end})"
    return None


def _compile_in_progress(path: Path) -> bool:
    """Whether TorchInductor holds the compile lock of the kernel that `path` belongs to
    (`<cache>/locks/<key>.lock`, `<key>` = the name up to its first dot)."""
    key = path.name.split(".", 1)[0].removesuffix(_BUILD_DIR_SUFFIX)
    for locks in (path.parent / "locks", path.parent.parent / "locks"):
        lock = locks / f"{key}.lock"
        if lock.is_file() and _flock_held(lock):
            return True
    return False


def _flock_held(lock: Path) -> bool:
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the probe's lock


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _head(path: Path, n: int) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(n)
    except OSError:
        return b""


def _is_inductor_default(value: str) -> bool:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        return False
    return os.path.abspath(value) == os.path.abspath(default_cache_dir())


def prebuild_ops() -> None:
    """Build DeepSpeed's CPU Adam into the project cache now (`scripts/install.sh` on the CPU
    stack), as the trainers' processes would on first use: about 1-2.5 min, which a first run
    or `openrlhf-oppo prepare` then does not spend."""
    use_project_cache()
    from deepspeed.ops.op_builder import CPUAdamBuilder

    with in_use(os.environ):  # a lock a killed build left is removed first
        CPUAdamBuilder().load()
