"""ZeRO-3 weight-integrity check on CPU (DeepSpeed 0.19.6 all-gather race on gloo).

DeepSpeed 0.19.6 on gloo could hand back corrupt weights after a ZeRO-3 load with
>= 2 ranks (see patches.zero3_sequential_allgather). This loads a checkpoint with
OpenRLHF 0.11.2's own `Actor` under the DeepSpeed eval config its strategy builds
(compat applied), on `world_size` gloo ranks, `loads` times, gathers every
parameter and compares it bit for bit with the file on disk.

    python -m openrlhf_oppo.compat.zero3_check MODEL_DIR [--unfixed]   # exit 0 when intact
"""

from __future__ import annotations

import os
import sys

from openrlhf_oppo.compat.ports import free_port


def _worker(rank: int, world_size: int, port: int, model_dir: str, loads: int, sequential: bool, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    from openrlhf_oppo import compat

    compat.apply()
    import deepspeed
    import torch
    from openrlhf.models import Actor
    from openrlhf.utils.deepspeed import deepspeed as ds_module
    from safetensors.torch import load_file

    deepspeed.init_distributed(dist_backend="gloo")
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
    if rank == 0:
        results.put(problems)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def check(model_dir: str, world_size: int = 2, loads: int = 3, sequential: bool = True) -> list[str]:
    """Problems found (empty: every parameter intact on every load).
    sequential=False turns the fix off, to see whether the race shows here."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, model_dir, loads, sequential, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = [f"rank {r} exited with {p.exitcode}" for r, p in enumerate(procs) if p.exitcode != 0]
    return failed + (results.get() if not results.empty() else ["rank 0 reported nothing"])


if __name__ == "__main__":
    found = check(sys.argv[1], sequential="--unfixed" not in sys.argv)
    print("\n".join(found) or "ZeRO-3 load intact")
    sys.exit(1 if found else 0)
