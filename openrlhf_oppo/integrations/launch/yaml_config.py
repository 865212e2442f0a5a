"""Our YAML run config -> OpenRLHF 0.11.2's own dotted flags.

    task:            # the built-in tiny task (openrlhf_oppo.tasks.tiny)
      assets: ~/.cache/openrlhf_oppo/tiny
    actor: {adam: {lr: 5.0e-4}, ...}   # any OpenRLHF namespace, nested = dotted flag
    train: {...}
    oppo: {...}      # OPPO's own config, parsed by openrlhf_oppo.config; passed through
    device: {name: "H100 or A100, 80 GB", memory_gb: 80}   # the GPU a cluster preset is sized for

A nested key `train: {async_enable: true}` is the flag `--train.async_enable`;
true/false for switch flags, lists for multi-value flags. Keys are checked against
the flags of `openrlhf.cli.train_ppo_ray` (see openrlhf_flags), so a typo is an
error naming the key, not a silently ignored setting. `device:` names the GPU a preset's
memory was counted for; the launch-time memory check uses it where neither
OPPO_DEVICE_MEMORY_GB nor the launching host's GPU says (`memory_check`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openrlhf_oppo import settings
from openrlhf_oppo.integrations.launch.openrlhf_flags import Flag, namespaces, train_flags

OUR_SECTIONS = ("task", "oppo", "device")
TASK_KEYS = ("assets", "variant", "fixed_lengths")
DEVICE_KEYS = ("name", "memory_gb")


@dataclass(frozen=True)
class RunConfig:
    path: Path
    flags: dict[str, Any]  # dotted OpenRLHF flag -> value
    task: dict[str, Any]
    oppo: dict[str, Any]  # reserved for openrlhf_oppo.config (not parsed here)
    device: dict[str, Any]  # {name, memory_gb} of the GPU the preset is sized for; {} without one


def load(path: str | Path) -> RunConfig:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--config: file not found: {path}")
    return from_mapping(settings.read_yaml(str(path)), path)


def from_mapping(raw: dict[str, Any], path: Path) -> RunConfig:
    table = train_flags()
    allowed = list(OUR_SECTIONS) + namespaces(table)
    flags: dict[str, Any] = {}
    for section, body in raw.items():
        if section not in allowed:
            raise ValueError(f"{path}: unknown top-level key '{section}'{settings.suggest(section, allowed)}; "
                             f"allowed: {', '.join(allowed)}")
        if section in OUR_SECTIONS:
            continue
        if not isinstance(body, dict):
            raise ValueError(f"{path}: '{section}' must be a mapping of OpenRLHF --{section}.* settings")
        _flatten(section, body, flags)
    for key in flags:
        if key not in table:
            close = [n for n in table if n.startswith(key.split(".", 1)[0] + ".")]
            raise ValueError(f"{path}: unknown key '{key}' (not a flag of OpenRLHF's train_ppo_ray)"
                             f"{settings.suggest(key, table)}; allowed in '{key.split('.', 1)[0]}': {', '.join(close)}")
    task = dict(raw.get("task") or {})
    for key in task:
        if key not in TASK_KEYS:
            raise ValueError(f"{path}: unknown key 'task.{key}'{settings.suggest(key, TASK_KEYS)}; "
                             f"allowed: {', '.join(TASK_KEYS)}")
    return RunConfig(path=path, flags=flags, task=task, oppo=dict(raw.get("oppo") or {}),
                     device=_device(raw.get("device"), path))


def _device(section: Any, path: Path) -> dict[str, Any]:
    """The `device:` section, checked: a name and the memory of one GPU in GB (> 0)."""
    if section is None:
        return {}
    if not isinstance(section, dict) or set(section) != set(DEVICE_KEYS):
        raise ValueError(f"{path}: 'device' must be a mapping with exactly the keys {', '.join(DEVICE_KEYS)}, e.g. "
                         "{name: H100 80 GB, memory_gb: 80}")
    gb = section["memory_gb"]
    if isinstance(gb, bool) or not isinstance(gb, (int, float)) or not gb > 0:
        raise ValueError(f"{path}: device.memory_gb must be a number of GB > 0, got {gb!r}")
    if not isinstance(section["name"], str) or not section["name"].strip():
        raise ValueError(f"{path}: device.name must name the GPU, got {section['name']!r}")
    return dict(section)


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
