"""The composition root of a run's processes: which patch lists a process installs.

Called by the site hook (`_site/sitecustomize.py`, on PYTHONPATH as
`openrlhf_oppo.hooks.SITE_DIR`) at the start of every Python process of a run: the
driver, Ray workers and actors, vLLM's engine subprocesses. Each list belongs to the
module that owns its patches; nothing is patched until the target module is imported.

    list                         installed                  what it does
    compat.caches.PATCHES        always                     stamped cpp_extension build locks
    compat.patches.PATCHES       OPPO_COMPAT=1 (no CUDA)    the CPU workarounds (each gated on CUDA absence)
    runtime.seeding.PATCHES      always                     seeded rollouts under --train.full_determinism_enable
    runtime.timeline_hooks.PATCHES  OPPO_TIMELINE_DIR set   timeline spans of OpenRLHF's stages
    runtime.micro_batches.PATCHES   an OPPO run's config    length-bucketed training micro-batches
                                    with train.length_buckets
"""

from __future__ import annotations

from collections.abc import Mapping

from openrlhf_oppo import run_env
from openrlhf_oppo.compat import caches, env, patches
from openrlhf_oppo.hooks import Patch, install_hooks
from openrlhf_oppo.integrations.runtime import micro_batches, seeding, timeline_hooks


def patch_lists(environ: Mapping[str, str] | None = None) -> list[tuple[Patch, ...]]:
    """The patch lists a process with this environment installs, in install order (two
    patches of one module run in this order: the timeline wraps the seeded sampler)."""
    lists = [caches.PATCHES]
    if run_env.compat_enabled(environ):
        lists.append(patches.PATCHES)
    lists.append(seeding.PATCHES)
    if run_env.path(run_env.TIMELINE_DIR, environ):
        lists.append(timeline_hooks.PATCHES)
    if micro_batches.enabled(environ):
        lists.append(micro_batches.PATCHES)
    return lists


def run() -> None:
    """Install this process's patch lists (see `patch_lists`)."""
    if run_env.compat_enabled():
        env.request_amx_permission()
    for patch_list in patch_lists():
        install_hooks(patch_list)
