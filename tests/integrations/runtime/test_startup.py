"""The composition root (integrations.runtime.startup): which patch lists a process of a
run installs, decided from its environment, and the site hook that runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from openrlhf_oppo import compat, hooks, run_env
from openrlhf_oppo.compat import caches, patches
from openrlhf_oppo.integrations.runtime import seeding, startup, timeline_hooks

REPO = Path(__file__).resolve().parents[3]


def test_cache_and_seeding_patches_go_everywhere_compat_and_timeline_only_when_asked():
    assert startup.patch_lists({}) == [caches.PATCHES, seeding.PATCHES]
    assert startup.patch_lists({run_env.COMPAT: "1"}) == [caches.PATCHES, patches.PATCHES, seeding.PATCHES]
    assert startup.patch_lists({run_env.TIMELINE_DIR: "/t"}) == [caches.PATCHES, seeding.PATCHES,
                                                                 timeline_hooks.PATCHES]
    assert startup.patch_lists({run_env.COMPAT: "0", run_env.TIMELINE_DIR: ""}) == [caches.PATCHES, seeding.PATCHES]


def test_every_patch_name_is_unique_across_the_lists():
    every = [p.name for lst in startup.patch_lists({run_env.COMPAT: "1", run_env.TIMELINE_DIR: "/t"}) for p in lst]
    assert len(every) == len(set(every))  # install_hooks skips a name it has seen


def test_compat_holds_only_its_cpu_workarounds():
    assert compat.PATCHES is patches.PATCHES
    names = {p.name for p in patches.PATCHES}
    assert not names & {p.name for p in seeding.PATCHES + timeline_hooks.PATCHES + caches.PATCHES}


def _site_hook_installs(environ: dict[str, str]) -> list[str]:
    """The patch names installed in a fresh process started with the site dir on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in (run_env.COMPAT, run_env.TIMELINE_DIR)}
    env.update(environ, PYTHONPATH=os.pathsep.join([str(hooks.SITE_DIR), str(REPO)]))
    code = "from openrlhf_oppo import hooks; print(','.join(sorted(hooks._INSTALLED)))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and "sitecustomize failed" not in proc.stderr, proc.stderr
    return [n for n in proc.stdout.strip().split(",") if n]


def test_the_site_hook_installs_the_lists_the_root_decides():
    assert _site_hook_installs({}) == []  # no run variable: an unrelated process is left alone
    timeline_run = {run_env.TIMELINE_DIR: "/tmp/oppo-timeline"}
    expected = {p.name for lst in startup.patch_lists(timeline_run) for p in lst}
    assert set(_site_hook_installs(timeline_run)) == expected
