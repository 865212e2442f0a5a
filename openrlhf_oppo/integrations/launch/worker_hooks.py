"""Whether the site hook reaches the run's Ray workers, said at start.

OPPO installs some of its patches in every process of a run through a `sitecustomize` on
PYTHONPATH (`openrlhf_oppo.hooks.SITE_DIR`, run by `integrations.runtime.startup`): the
length-bucketed training micro-batches in the actor and critic processes, the seeded prompt
order of `--train.full_determinism_enable` in the trainer actor, the timeline spans, the CPU
compat layer. `openrlhf-oppo train` puts SITE_DIR on the PYTHONPATH of the process tree it
starts; on a cluster the workers' environment is Ray's, so the driver forwards a PYTHONPATH
with SITE_DIR first in its runtime env (`worker_pythonpath`, merged with the user's).

That reaches a node only where SITE_DIR's path exists on it and where the job's own runtime env
does not set PYTHONPATH (Ray keeps the job's). So after `ray.init` the driver runs one task on
every node (`probe`), each reporting whether the hook ran in its worker process, and `check`
says at start where it is active, or ends the run (`SiteHookMissing`) when something the run
asks for needs it on a node where it is not.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from openrlhf_oppo import hooks, run_env

PROBE_TIMEOUT_S = 120.0  # one worker start per node (Ray may first fetch the job's working_dir there)
RAY_PYTHONPATH = "${PYTHONPATH}"  # Ray expands it to the node's own PYTHONPATH when it starts a worker


class SiteHookMissing(RuntimeError):
    """The run needs the site hook on a node where it is not active, or the check could not tell."""


def worker_pythonpath(environ: Mapping[str, str]) -> str:
    """The PYTHONPATH the driver gives its Ray workers: SITE_DIR first, then the driver's own
    entries (the user's), then the node's own (`${PYTHONPATH}`, expanded by Ray on each node)."""
    return os.pathsep.join([hooks.site_pythonpath(environ.get("PYTHONPATH", "")), RAY_PYTHONPATH])


def worker_state() -> dict:
    """Run in a Ray worker: this process's host, where its `sitecustomize` came from (None: not
    OPPO's site hook) and the names of the patches the hook installed."""
    site = sys.modules.get("sitecustomize")
    site_file = getattr(site, "__file__", None)
    ours = site_file is not None and os.path.dirname(os.path.abspath(site_file)).endswith(
        os.path.join("integrations", "runtime", "_site"))
    return {"host": socket.gethostname(), "site_hook": site_file if ours else None,
            "installed": sorted(hooks._INSTALLED)}


def probe(timeout_s: float = PROBE_TIMEOUT_S) -> list[dict]:
    """`worker_state` from one worker on every alive node of the Ray cluster (a task of no CPU, so
    it never waits behind the run's own reservations); SiteHookMissing after `timeout_s`."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0)(worker_state)
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    refs = {task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote():
            node.get("NodeManagerAddress", node["NodeID"]) for node in nodes}
    ready, waiting = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    if waiting:
        raise SiteHookMissing(
            f"the site-hook check waited {timeout_s:.0f} s for a worker on {len(waiting)} of {len(refs)} Ray "
            f"nodes ({', '.join(sorted(refs[r] for r in waiting))}) and got none: the nodes cannot start a "
            f"worker with the job's runtime env (see the Ray dashboard's job and runtime-env logs)")
    return [{**state, "host": f"{state['host']} ({refs[ref]})"} for ref, state in zip(ready, ray.get(ready))]


@dataclass(frozen=True)
class Need:
    what: str  # what the run asks for, named as the user sets it
    patches: frozenset[str]  # the patch names the hook installs for it


# OpenRLHF flags that decide what needs the hook (`needs` takes the ones given)
FLAGS = ("--ds.packing_samples", "--train.dynamic_batch_enable", "--train.full_determinism_enable")


def needs(length_buckets: bool, given: set[str], environ: Mapping[str, str] | None = None) -> list[Need]:
    """What this run asks for that only the site hook provides in the workers: `length_buckets`
    is the OPPO config's, `given` the FLAGS on the command line, `environ` the driver's."""
    from openrlhf_oppo.compat import patches as compat_patches
    from openrlhf_oppo.integrations.runtime import micro_batches, seeding, timeline_hooks

    def names(patch_list) -> frozenset[str]:
        return frozenset(p.name for p in patch_list)

    out = []
    if length_buckets and not given & {"--ds.packing_samples", "--train.dynamic_batch_enable"}:
        out.append(Need("length-bucketed training micro-batches (--oppo.train.length_buckets, on by default)",
                        names(micro_batches.PATCHES)))
    if "--train.full_determinism_enable" in given:
        out.append(Need("the seeded prompt order of --train.full_determinism_enable", names(seeding.PATCHES)))
    if run_env.path(run_env.TIMELINE_DIR, environ):
        out.append(Need(f"the timeline spans of {run_env.TIMELINE_DIR}", names(timeline_hooks.PATCHES)))
    if run_env.compat_enabled(environ):
        out.append(Need(f"the CPU compat layer ({run_env.COMPAT}=1)", names(compat_patches.PATCHES)))
    return out


def report(states: list[dict], wanted: list[Need]) -> str:
    """The start-up line on the site hook in the workers; SiteHookMissing naming the nodes and
    what needs it, when a node lacks what the run asks for."""
    active = [s for s in states if s["site_hook"]]
    missing = {}
    for need in wanted:
        hosts = sorted(s["host"] for s in states if not need.patches <= set(s["installed"]))
        if hosts:
            missing[need.what] = hosts
    if missing:
        lines = "; ".join(f"{what} on {', '.join(hosts)}" for what, hosts in missing.items())
        raise SiteHookMissing(
            f"the site hook ({hooks.SITE_DIR} on the workers' PYTHONPATH) is not active where this run needs it: "
            f"{lines}. The driver forwards PYTHONPATH with that folder first; it is missing on a node where the "
            f"path does not exist (put the repository at the same path on every node, or submit it as the job's "
            f"working_dir as examples/scripts do) and wherever the job's --runtime-env-json sets PYTHONPATH itself "
            f"(leave it out: the driver forwards yours). To run without it, turn off what needs it "
            f"(--oppo.train.length_buckets false for the micro-batches)")
    where = f"on {len(active)} of {len(states)} Ray nodes"
    if len(active) == len(states):
        uses = "; ".join(need.what for need in wanted) or "nothing this run asks for needs it"
        return f"the site hook is active in the Ray workers {where} ({uses})"
    return (f"the site hook is active in the Ray workers {where} (not on "
            f"{', '.join(sorted(s['host'] for s in states if not s['site_hook']))}): nothing this run asks "
            f"for needs it there")


def check(length_buckets: bool, given: set[str]) -> str:
    """Probe the workers of the running Ray cluster and return the start-up line (see `report`)."""
    return report(probe(), needs(length_buckets, given, os.environ))
