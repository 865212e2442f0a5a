"""Every `OPPO_*` environment variable of a run, its name once and a typed reader.

The launcher (`openrlhf-oppo train`) and the Ray driver set these; every process of the
run (Ray actors, vLLM engine subprocesses) reads them here. A reader takes the mapping
to read (default: this process's environment), so a test hands it a dict.

Stdlib only: the launcher, the sitecustomize hook and the core's ledger import it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

# -- set by the Ray driver (`python -m openrlhf_oppo.cli.train_ppo_ray`) --------------------
CONFIG_JSON = "OPPO_CONFIG_JSON"  # the resolved OppoConfig as JSON, read by the trainer actor
# -- set by the launcher for one run directory (a cluster job may set them itself) -----------
METRICS_JSONL = "OPPO_METRICS_JSONL"  # one JSON line of OpenRLHF's + oppo/* metrics per step
TRACE_JSONL = "OPPO_TRACE_JSONL"  # one JSON line per OPPO step: admitted, trained, carried
ROLLOUTS_JSONL = "OPPO_ROLLOUTS_JSONL"  # each step's trained samples (every schedule)
LEDGER_JSONL = "OPPO_LEDGER_JSONL"  # admitted / trained / restart events, appended across restarts
STOP_FILE = "OPPO_STOP_FILE"  # when this file exists, the step ends, a checkpoint is written, the run stops
TIMELINE_DIR = "OPPO_TIMELINE_DIR"  # each process appends its stage spans here
SYNC_PROBE = "OPPO_SYNC_PROBE"  # CPU weight sync: where the vLLM-vs-actor probe writes
SYNC_PROBE_PROMPT = "OPPO_SYNC_PROBE_PROMPT"  # the probe's prompt, comma-separated token ids
FIXED_LENGTHS = "OPPO_FIXED_LENGTHS"  # "median,sigma,seed" of task.fixed_lengths (integrations.runtime.fixed_lengths)
COMPAT = "OPPO_COMPAT"  # "1": the sitecustomize installs the CPU compat patches
SKIP_INPUT_CHECKS = "OPPO_SKIP_INPUT_CHECKS"  # "1": the cluster entry skips the dataset / tokenizer checks
CHECKED = "OPPO_CHECKED"  # "1": the launcher printed the memory check; the cluster entry makes it again, silently
# -- set by the user -------------------------------------------------------------------------
FAULTS = "OPPO_FAULTS"  # crash injection for the reliability tests, e.g. "reward@1,driver@3"
CACHE_DIR = "OPPO_CACHE_DIR"  # the per-user project cache (tasks' assets, compile caches)
ASSETS_DIR = "OPPO_ASSETS_DIR"  # the tiny task's assets
# GB of one GPU, for the launch-time memory check (integrations.launch.memory_check) where the
# launching host has no GPU; unset there: the preset's `device:` section, else nothing is counted
DEVICE_MEMORY_GB = "OPPO_DEVICE_MEMORY_GB"

DEFAULT_CACHE_DIR = "~/.cache/openrlhf_oppo"
DEFAULT_ASSETS_DIR = "~/.cache/openrlhf_oppo/tiny"

ALL = (CONFIG_JSON, METRICS_JSONL, TRACE_JSONL, ROLLOUTS_JSONL, LEDGER_JSONL, STOP_FILE, TIMELINE_DIR,
       SYNC_PROBE, SYNC_PROBE_PROMPT, FIXED_LENGTHS, COMPAT, SKIP_INPUT_CHECKS, CHECKED, FAULTS, CACHE_DIR, ASSETS_DIR,
       DEVICE_MEMORY_GB)


def _env(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def path(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The file or folder a path variable names; None when unset or empty."""
    if name not in ALL:
        raise KeyError(f"{name} is not an OPPO_* variable of openrlhf_oppo.run_env")
    return _env(environ).get(name) or None


def config_json(environ: Mapping[str, str] | None = None) -> str | None:
    return _env(environ).get(CONFIG_JSON)


def fixed_lengths(environ: Mapping[str, str] | None = None) -> str | None:
    return _env(environ).get(FIXED_LENGTHS) or None


def compat_enabled(environ: Mapping[str, str] | None = None) -> bool:
    return _env(environ).get(COMPAT) == "1"


def stop_requested(environ: Mapping[str, str] | None = None) -> bool:
    """The launcher was asked to stop: its stop file exists."""
    stop = path(STOP_FILE, environ)
    return stop is not None and os.path.exists(stop)


def faults(environ: Mapping[str, str] | None = None) -> list[str]:
    """The injected faults, e.g. ["reward@1", "driver@3"]."""
    return [item for item in _env(environ).get(FAULTS, "").split(",") if item]


def sync_probe_prompt(environ: Mapping[str, str] | None = None) -> list[int]:
    return [int(t) for t in _env(environ).get(SYNC_PROBE_PROMPT, "1").split(",")]


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    return Path(_env(environ).get(CACHE_DIR, DEFAULT_CACHE_DIR)).expanduser()


def assets_dir(environ: Mapping[str, str] | None = None) -> Path:
    return Path(_env(environ).get(ASSETS_DIR, DEFAULT_ASSETS_DIR)).expanduser()
