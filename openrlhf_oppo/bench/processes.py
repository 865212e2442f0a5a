"""The processes of a run, by name: the launcher's descendants and the sessions its children lead
(Ray's daemons, the driver, each Ray actor by its process title, vLLM's engine core). Read by
`bench schedules`' CPU accounting (`cpu_use`) and the lab's soak run."""

from __future__ import annotations

import os

IDLE_NAMES = ("ray::IDLE",)  # a pooled Ray worker before it hosts an actor or task


def process_name(cmdline: list[str], fallback: str = "?") -> str:
    """A readable name from a process's command line: Ray's and vLLM's process titles
    (`ray::OppoRolloutActor.process` -> `ray::OppoRolloutActor`), `python -m MODULE`,
    a script's or a binary's base name."""
    parts = [c for c in cmdline if c]
    if not parts:
        return fallback
    first = parts[0]
    if "::" in first.split(" ")[0]:  # process titles: ray::Class.method, VLLM::EngineCore
        title = first.split(" ")[0]
        prefix, _, rest = title.partition("::")
        return f"{prefix}::{rest.split('.')[0]}"
    if " (" in first and not first.startswith("/"):  # ray-dashboard-ReportHead-0 (/path/python -c ...)
        return first.split(" (")[0]
    exe = os.path.basename(first.split(" ")[0])
    if exe.startswith("python"):
        args = parts[1:]
        for i, a in enumerate(args):
            if a == "-m" and i + 1 < len(args):
                return args[i + 1]
            if a == "-c":
                code = " ".join(args[i + 1:])
                return "python -c " + ("(multiprocessing)" if "multiprocessing" in code else "…")
            if not a.startswith("-"):
                return os.path.basename(a)
        return exe
    return exe


def run_processes(root_pid: int) -> dict[int, str]:
    """pid -> name of every process of the run under `root_pid`: its descendants, and
    every process in the sessions its children lead (the launcher starts the run with
    `start_new_session`; daemons that left the tree stay in the session)."""
    import psutil

    try:
        root = psutil.Process(root_pid)
        procs = {p.pid: p for p in root.children(recursive=True)}
    except psutil.NoSuchProcess:
        return {}
    sessions = set()
    for pid in list(procs):
        try:
            if os.getsid(pid) == pid:
                sessions.add(pid)
        except OSError:
            pass
    if sessions:
        for p in psutil.process_iter():
            try:
                if p.pid not in procs and os.getsid(p.pid) in sessions:
                    procs[p.pid] = p
            except OSError:
                pass
    out = {root_pid: "launcher"}
    for pid, p in procs.items():
        try:
            out[pid] = process_name(p.cmdline(), p.name())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out
