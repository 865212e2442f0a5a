"""Our YAML run config -> OpenRLHF 0.11.2's own dotted flags.

    task:            # the built-in tiny task (openrlhf_oppo.tasks.tiny)
      assets: ~/.cache/openrlhf_oppo/tiny
    actor: {adam: {lr: 5.0e-4}, ...}   # any OpenRLHF namespace, nested = dotted flag
    train: {...}
    oppo: {...}      # OPPO's own config, parsed by openrlhf_oppo.config; passed through

A nested key `train: {async_enable: true}` is the flag `--train.async_enable`;
true/false for switch flags, lists for multi-value flags. Keys are checked against
the flags of `openrlhf.cli.train_ppo_ray` (see openrlhf_flags), so a typo is an
error naming the key, not a silently ignored setting.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openrlhf_oppo.integrations.launch.openrlhf_flags import Flag, namespaces, train_flags

OUR_SECTIONS = ("task", "oppo")
TASK_KEYS = ("assets", "variant", "fixed_lengths")


@dataclass(frozen=True)
class RunConfig:
    path: Path
    flags: dict[str, Any]  # dotted OpenRLHF flag -> value
    task: dict[str, Any]
    oppo: dict[str, Any]  # reserved for openrlhf_oppo.config (not parsed here)


def load(path: str | Path) -> RunConfig:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--config: file not found: {path}")
    with path.open() as f:
        raw = yaml.safe_load(f) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: top level must be a mapping of sections")
    return from_mapping(raw, path)


def from_mapping(raw: dict[str, Any], path: Path) -> RunConfig:
    table = train_flags()
    allowed = list(OUR_SECTIONS) + namespaces(table)
    flags: dict[str, Any] = {}
    for section, body in raw.items():
        if section not in allowed:
            raise ValueError(f"{path}: unknown top-level key '{section}'; allowed: {', '.join(allowed)}")
        if section in OUR_SECTIONS:
            continue
        if not isinstance(body, dict):
            raise ValueError(f"{path}: '{section}' must be a mapping of OpenRLHF --{section}.* settings")
        _flatten(section, body, flags)
    for key in flags:
        if key not in table:
            close = [n for n in table if n.startswith(key.split(".", 1)[0] + ".")]
            raise ValueError(f"{path}: unknown key '{key}' (not a flag of OpenRLHF's train_ppo_ray); "
                             f"allowed in '{key.split('.', 1)[0]}': {', '.join(close)}")
    task = dict(raw.get("task") or {})
    for key in task:
        if key not in TASK_KEYS:
            raise ValueError(f"{path}: unknown key 'task.{key}'; allowed: {', '.join(TASK_KEYS)}")
    return RunConfig(path=path, flags=flags, task=task, oppo=dict(raw.get("oppo") or {}))


def _flatten(prefix: str, body: dict[str, Any], out: dict[str, Any]) -> None:
    for key, value in body.items():
        name = f"{prefix}.{key}"
        if isinstance(value, dict):
            _flatten(name, value, out)
        else:
            out[name] = value


def to_argv(flags: dict[str, Any], table: dict[str, Flag] | None = None) -> list[str]:
    """Dotted flags -> argv for train_ppo_ray. Switches: true -> `--x`, false -> omitted."""
    table = train_flags() if table is None else table
    argv: list[str] = []
    for name, value in flags.items():
        kind = table[name].kind
        if kind in ("bool", "negated"):
            if not isinstance(value, bool):
                raise ValueError(f"--{name}: is a switch; use true or false, got {value!r}")
            if value:
                argv.append(f"--{name}")
        elif value is None:
            continue
        elif kind == "list" and isinstance(value, (list, tuple)):
            argv += [f"--{name}", *[str(v) for v in value]]
        else:
            argv += [f"--{name}", str(value)]
    return argv
