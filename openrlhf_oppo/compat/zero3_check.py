"""ZeRO-3 weight-integrity check on CPU (DeepSpeed 0.19.6 all-gather race on gloo).

DeepSpeed 0.19.6 on gloo could hand back corrupt weights after a ZeRO-3 load with
>= 2 ranks (see patches.zero3_sequential_allgather). This loads a checkpoint with
OpenRLHF 0.11.2's own `Actor` under the DeepSpeed eval config its strategy builds
(compat applied), on `world_size` gloo ranks, `loads` times, gathers every
parameter and compares it bit for bit with the file on disk.

    python -m openrlhf_oppo.compat.zero3_check MODEL_DIR [--unfixed]   # exit 0 when intact

The ranks build DeepSpeed's ops (the shared-memory op, in `init_distributed`) in the
project cache with the stale-lock handling, as a run's processes do (`compat.caches`),
and every wait is bounded: the check, its gloo group, and a build lock.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from multiprocessing import connection
from pathlib import Path

from openrlhf_oppo.compat import caches
from openrlhf_oppo.compat.ports import free_port

# the whole check; a first run also builds the shared-memory op (about a minute here)
TIMEOUT_S = 900.0
# one gloo collective: a rank whose peer died ends instead of waiting torch's default 30 min
GROUP_TIMEOUT_S = 300.0
END_GRACE_S = 10.0  # a rank asked to end (SIGTERM) gets this long before SIGKILL


def _worker(rank: int, world_size: int, port: int, model_dir: str, loads: int, sequential: bool,
            report: str) -> None:
    caches.use_project_cache()  # before DeepSpeed builds its shared-memory op
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    from openrlhf_oppo import compat

    compat.apply()
    import deepspeed
    import torch
    from openrlhf.models import Actor
    from openrlhf.utils.deepspeed import deepspeed as ds_module
    from safetensors.torch import load_file

    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    ds_config = ds_module.get_eval_ds_config(offload=False, stage=3, param_dtype="bf16")
    ds_config.update(train_micro_batch_size_per_gpu=1, train_batch_size=world_size)
    expected = load_file(os.path.join(model_dir, "model.safetensors"))
    problems = []
    if ds_config["zero_optimization"].get("stage3_allgather_sequential") is not True:
        problems.append("stage3_allgather_sequential not set by the compat patch")
    if not sequential:  # reproduce the upstream race (diagnostics only)
        ds_config["zero_optimization"]["stage3_allgather_sequential"] = False
    for attempt in range(loads):
        actor = Actor(model_dir, attn_implementation="sdpa", param_dtype="bf16", ds_config=ds_config)
        for name, param in actor.model.named_parameters():
            with deepspeed.zero.GatheredParameters([param]):
                if rank == 0 and not torch.equal(param.data.to(expected[name].dtype), expected[name]):
                    diff = (param.data.float() - expected[name].float()).abs().max().item()
                    problems.append(f"load {attempt}: {name} differs (max abs {diff:.3g})")
        del actor
    if rank == 0:  # whole or absent: a rank ended mid-write leaves no half report
        partial = Path(f"{report}.partial")
        partial.write_text(json.dumps(problems))
        os.replace(partial, report)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def check(model_dir: str, world_size: int = 2, loads: int = 3, sequential: bool = True,
          timeout_s: float = TIMEOUT_S) -> list[str]:
    """Problems found (empty: every parameter intact on every load).
    sequential=False turns the fix off, to see whether the race shows here. The ranks
    get `timeout_s` in all; one still running then, or once another rank failed, is
    ended and named in the problems. The project cache is validated first (a build lock
    a killed run left is removed) and held while the ranks run."""
    import torch.multiprocessing as mp

    caches.use_project_cache()  # the ranks inherit the cache variables
    ctx = mp.get_context("spawn")
    port = free_port()
    with caches.in_use(os.environ), tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "problems.json"
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, model_dir, loads, sequential, str(report)))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            in_time = _wait(procs, timeout_s)
            late = [] if in_time else [r for r, p in enumerate(procs) if p.exitcode is None]
        finally:
            _end(procs)
        failed = []
        for r, p in enumerate(procs):
            if r in late:
                failed.append(f"rank {r} still running after {timeout_s:.0f}s (its DeepSpeed set-up and {loads} "
                              "loads): ended")
            elif p.exitcode != 0:
                failed.append(f"rank {r} exited with {p.exitcode}")
        return failed + (json.loads(report.read_text()) if report.exists() else ["rank 0 reported nothing"])


def _wait(procs: list, timeout_s: float) -> bool:
    """Wait until every rank has exited or one has failed (the others would wait on it in
    a collective), at most `timeout_s`; whether that came first."""
    deadline = time.monotonic() + timeout_s
    running = list(procs)
    while running and not any(p.exitcode for p in procs):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        connection.wait([p.sentinel for p in running], timeout=left)
        running = [p for p in running if p.exitcode is None]
    return True


def _end(procs: list) -> None:
    """End the ranks still running: SIGTERM, then SIGKILL after `END_GRACE_S`."""
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    deadline = time.monotonic() + END_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join(END_GRACE_S)


if __name__ == "__main__":
    found = check(sys.argv[1], sequential="--unfixed" not in sys.argv)
    print("\n".join(found) or "ZeRO-3 load intact")
    sys.exit(1 if found else 0)
