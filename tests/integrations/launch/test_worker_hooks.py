"""The site hook reaches the Ray workers of a cluster run (`integrations.launch.worker_hooks`).

Length-bucketed training micro-batches, the seeded prompt order and the timeline install through
a `sitecustomize` on PYTHONPATH. `openrlhf-oppo train` sets it for the processes it starts; under
`ray job submit` the workers' environment is Ray's, so the cluster entry forwards a PYTHONPATH with
the hook's folder first (the user's entries after it, the node's own last) and says at start
whether the hook is active on every node, or refuses when the run needs it where it is not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from openrlhf_oppo import config as oppo_config
from openrlhf_oppo import hooks, run_env
from openrlhf_oppo.integrations.launch import driver, worker_hooks
from openrlhf_oppo.integrations.runtime import micro_batches, seeding

REPO = Path(__file__).resolve().parents[3]
OPPO_CONFIG = json.dumps(oppo_config.to_dict(oppo_config.OppoConfig()))  # train.length_buckets on, the default


def test_the_workers_pythonpath_puts_the_site_hook_first_and_keeps_the_users():
    env = driver.driver_env_vars({"PYTHONPATH": f"/user/lib{os.pathsep}/user/more", run_env.CONFIG_JSON: "{}"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(hooks.SITE_DIR), "/user/lib", "/user/more", "${PYTHONPATH}"]
    assert driver.driver_env_vars({})["PYTHONPATH"].split(os.pathsep) == [str(hooks.SITE_DIR), "${PYTHONPATH}"]


def test_ray_gives_a_worker_the_job_dir_the_hook_the_users_entries_and_the_nodes_own(monkeypatch):
    """What Ray 2.55 makes of it when it starts a worker: the job's working_dir first (its
    working_dir plugin), then the env var as given, `${PYTHONPATH}` expanded to the node's own."""
    from ray._private.runtime_env.context import RuntimeEnvContext
    from ray._private.runtime_env.working_dir import set_pythonpath_in_context
    from ray._private.utils import update_envs

    monkeypatch.setenv("PYTHONPATH", "/node/lib")  # the raylet's, which a worker's start-up inherits
    context = RuntimeEnvContext(env_vars={"PYTHONPATH": driver.driver_env_vars({"PYTHONPATH": "/user/lib"})[
        "PYTHONPATH"]})
    set_pythonpath_in_context("/tmp/ray/session/runtime_resources/working_dir_files/_ray_pkg_x", context)
    update_envs(context.env_vars)
    entries = os.environ["PYTHONPATH"].split(os.pathsep)
    assert entries[:3] == ["/tmp/ray/session/runtime_resources/working_dir_files/_ray_pkg_x", str(hooks.SITE_DIR),
                           "/user/lib"]
    assert "/node/lib" in entries and "${PYTHONPATH}" not in entries


def _worker(env_vars: dict[str, str]) -> dict:
    """`worker_state` in a fresh Python process started with the runtime env's variables (the
    node's own PYTHONPATH, which `${PYTHONPATH}` stands for, being this checkout)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPPO_") and k != "PYTHONPATH"}
    env.update({k: v.replace("${PYTHONPATH}", str(REPO)) for k, v in env_vars.items()})
    env.setdefault("PYTHONPATH", str(REPO))
    code = "import json; from openrlhf_oppo.integrations.launch import worker_hooks; print(json.dumps(" \
           "worker_hooks.worker_state()))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                          cwd=REPO)
    assert proc.returncode == 0 and "sitecustomize failed" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_worker_started_with_the_forwarded_env_buckets_its_training_micro_batches():
    """Before the entry forwarded PYTHONPATH, a worker got OPPO's config but not the hook: the
    micro-batches were silently off."""
    state = _worker(driver.driver_env_vars({run_env.CONFIG_JSON: OPPO_CONFIG}))
    assert state["site_hook"] == str(hooks.SITE_DIR / "sitecustomize.py")
    assert {p.name for p in micro_batches.PATCHES} <= set(state["installed"])
    wanted = worker_hooks.needs(True, set(), {})
    assert "is active in the Ray workers on 1 of 1 Ray nodes" in worker_hooks.report([state], wanted)


def test_a_worker_without_the_hook_is_found_and_the_run_refused_naming_node_and_flag():
    state = _worker({run_env.CONFIG_JSON: OPPO_CONFIG})  # what a job's own PYTHONPATH would give
    assert state["site_hook"] is None and state["installed"] == []
    with pytest.raises(worker_hooks.SiteHookMissing) as exc:
        worker_hooks.report([state], worker_hooks.needs(True, set(), {}))
    message = str(exc.value)
    assert state["host"] in message and "--oppo.train.length_buckets" in message
    assert str(hooks.SITE_DIR) in message and "--oppo.train.length_buckets false" in message


def _state(host: str, lists=()) -> dict:
    names = sorted(p.name for patch_list in lists for p in patch_list)
    return {"host": host, "site_hook": "/x/integrations/runtime/_site/sitecustomize.py" if lists else None,
            "installed": names}


def test_the_report_names_what_needs_the_hook_and_where_it_is_missing():
    both = (micro_batches.PATCHES, seeding.PATCHES)
    wanted = worker_hooks.needs(True, set(), {})
    assert worker_hooks.report([_state("a", both), _state("b", both)], wanted) == (
        "the site hook is active in the Ray workers on 2 of 2 Ray nodes (length-bucketed training micro-batches "
        "(--oppo.train.length_buckets, on by default))")
    with pytest.raises(worker_hooks.SiteHookMissing, match=r"micro-batches .* on b\."):
        worker_hooks.report([_state("a", both), _state("b")], wanted)
    # nothing asks for it: said, not refused
    line = worker_hooks.report([_state("a", both), _state("b")], worker_hooks.needs(False, set(), {}))
    assert line.startswith("the site hook is active in the Ray workers on 1 of 2 Ray nodes (not on b)")
    # packing or dynamic batches leave nothing to bucket; full determinism needs the seeded prompt order
    assert worker_hooks.needs(True, {"--ds.packing_samples"}, {}) == []
    assert worker_hooks.needs(True, {"--train.dynamic_batch_enable"}, {}) == []
    with pytest.raises(worker_hooks.SiteHookMissing, match="--train.full_determinism_enable on b"):
        worker_hooks.report([_state("a", both), _state("b", [micro_batches.PATCHES])],
                            worker_hooks.needs(True, {"--train.full_determinism_enable"}, {}))
    timeline = worker_hooks.needs(False, set(), {run_env.TIMELINE_DIR: "/shared/t"})
    assert [n.what for n in timeline] == [f"the timeline spans of {run_env.TIMELINE_DIR}"]


def test_the_cluster_entry_ends_the_run_with_the_refusal(tmp_path, monkeypatch, capsys):
    from openrlhf_oppo.integrations.launch import cluster_entry

    def refused(cfg, rest):
        raise worker_hooks.SiteHookMissing("the site hook (...) is not active where this run needs it: ...")

    monkeypatch.setattr(driver, "run_openrlhf", refused)
    monkeypatch.setenv(run_env.SKIP_INPUT_CHECKS, "1")
    assert cluster_entry.main(["--actor.model_name_or_path", "org/m", "--reward.remote_url", "r.py"]) == 2
    assert capsys.readouterr().err.startswith(f"{driver.ENTRY_MODULE}: error: the site hook (...) is not active")


@pytest.mark.slow
def test_on_a_local_ray_cluster_the_probe_finds_the_hook_in_its_worker(monkeypatch):
    """The driver's runtime env on a real Ray: the probe's task starts a worker that ran the hook."""
    import ray

    monkeypatch.setenv(run_env.CONFIG_JSON, OPPO_CONFIG)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    ray.init(num_cpus=1, include_dashboard=False, runtime_env={"env_vars": driver.driver_env_vars(os.environ)})
    try:
        line = worker_hooks.check(True, set())
    finally:
        ray.shutdown()
    assert line.startswith("the site hook is active in the Ray workers on 1 of 1 Ray nodes (length-bucketed")
