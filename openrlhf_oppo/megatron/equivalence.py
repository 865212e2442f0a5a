"""One PPO step, twice: by OpenRLHF's actor (a Hugging Face model, `openrlhf.models.Actor`,
`PolicyLoss`, gradient clipping and AdamW, what the DeepSpeed backend computes) and by the
Megatron backend at a given TP/PP on gloo processes, from the same weights and batch. Each
returns the action log-probs before the step, the loss, the gradient norm, the log-probs after
the step and the weights after it under Hugging Face names (on the Megatron side gathered from
the shards by `export.hf_weights`, which also must give back the loaded weights exactly).

`megatron_step(case, tp, pp)` spawns tp*pp processes (CPU under `compat.megatron_cpu`, or a GPU each);
`tests/megatron/test_equivalence.py` holds both sides to a stated tolerance.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch

from openrlhf_oppo.megatron.engine import MicroBatch, Settings

SPAWN_TIMEOUT_S = 900.0  # one set of ranks, start to exit (a minute or two on a CPU host)
GROUP_TIMEOUT_S = 600.0  # one gloo collective: a rank whose peer died ends instead of waiting 30 min


@dataclass
class Case:
    hf_config: object
    hf_state: dict[str, torch.Tensor]
    batches: list[MicroBatch]
    settings: Settings = field(default_factory=Settings)


def reference_step(case: Case) -> dict:
    """The step as OpenRLHF 0.11.2's DeepSpeed actor computes it: each micro-batch's loss
    normalised by the whole step's tokens (`iter_grad_accum_global_norm`), scaled by 1/gas as
    DeepSpeed's accumulation does, the global gradient norm clipped, then AdamW."""
    from openrlhf_oppo import compat

    compat.apply()
    from openrlhf.models import Actor
    from openrlhf.models.loss import PolicyLoss, aggregate_loss
    from openrlhf.models.utils import compute_approx_kl
    from openrlhf.utils.loss_utils import iter_grad_accum_global_norm
    from transformers import AutoModelForCausalLM

    s = case.settings
    hf = AutoModelForCausalLM.from_config(case.hf_config, torch_dtype=s.dtype, attn_implementation="eager")
    hf.load_state_dict(case.hf_state)
    actor = Actor(hf, temperature=s.temperature)
    actor.packing_samples = False  # 0.11.2 sets it only when Actor loads the model from a path
    loss_fn = PolicyLoss(s.clip_eps_low, s.clip_eps_high, **s.loss_kwargs)
    optim = torch.optim.AdamW(actor.parameters(), lr=s.lr, betas=s.betas, eps=s.eps, weight_decay=s.weight_decay)

    def log_probs() -> list[torch.Tensor]:
        with torch.no_grad():
            return [actor(mb.sequences, mb.action_mask, attention_mask=mb.attention_mask) for mb in case.batches]

    before = log_probs()
    losses = []
    gas = len(case.batches)  # gradient accumulation steps: one optimizer step over every micro-batch
    no_mesh = type("Strategy", (), {})()  # one data-parallel rank: no device mesh
    for mb, norm in iter_grad_accum_global_norm(case.batches, no_mesh, gas, lambda mb: mb.action_mask):
        lp = actor(mb.sequences, mb.action_mask, attention_mask=mb.attention_mask)
        loss = loss_fn(lp, mb.old_log_probs, mb.advantages, action_mask=mb.action_mask,
                       rollout_log_probs=mb.rollout_log_probs, **norm)[0]
        if s.kl_coef > 0:
            kl = compute_approx_kl(lp, mb.base_log_probs, log_probs_old=mb.old_log_probs, kl_estimator=s.kl_estimator)
            loss = loss + aggregate_loss(kl, mb.action_mask, **norm) * s.kl_coef
        (loss / gas).backward()
        losses.append(loss.detach() / gas)
    grad_norm = torch.nn.utils.clip_grad_norm_(actor.parameters(), s.clip_grad)
    optim.step()
    return {"before": before, "loss": float(torch.stack(losses).sum()), "grad_norm": float(grad_norm),
            "after": log_probs(), "weights": {k: v.detach().clone() for k, v in hf.state_dict().items()}}


@contextlib.contextmanager
def _megatron_rank(rank: int, world: int, tp: int, pp: int, port: int, case_path: str):
    """This process as one rank of a gloo group with Megatron's groups: the case and its actor."""
    import torch.distributed as dist

    from openrlhf_oppo.compat.megatron_cpu import on_cpu
    from openrlhf_oppo.megatron import parallel
    from openrlhf_oppo.megatron.engine import MegatronActor

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        case: Case = torch.load(case_path, weights_only=False)
        with on_cpu():
            parallel.initialize(tp, pp, seed=0)
            yield case, MegatronActor(case.hf_config, case.hf_state, case.settings)
            parallel.destroy()
    finally:
        dist.destroy_process_group()


def _worker(rank: int, world: int, tp: int, pp: int, port: int, case_path: str, out_path: str) -> None:
    from megatron.core import parallel_state as ps

    from openrlhf_oppo.megatron import export

    with _megatron_rank(rank, world, tp, pp, port, case_path) as (case, actor):
        loaded = {name: t.clone() for name, t in export.hf_weights(actor.model.module, actor.shape)}
        before = actor.log_probs(case.batches)
        stats = actor.train_step(case.batches)
        after = actor.log_probs(case.batches)
        weights = {name: t.clone() for name, t in export.hf_weights(actor.model.module, actor.shape)}
        if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0:
            loss = stats["policy_loss"] + stats.get("kl", 0.0) * case.settings.kl_coef
            torch.save({"before": before, "loss": loss, "grad_norm": stats["grad_norm"], "after": after,
                        "loaded": loaded, "weights": weights}, out_path)


def _resume_worker(rank: int, world: int, tp: int, pp: int, port: int, case_path: str, out_path: str,
                   ckpt: str, phase: str) -> None:
    """`phase` "save": a step, then a checkpoint; "resume": load it; "straight": two steps. Each
    phase then takes one more step and writes the log-probs after it."""
    with _megatron_rank(rank, world, tp, pp, port, case_path) as (case, actor):
        if phase == "resume":
            actor.load(ckpt)
        else:
            actor.train_step(case.batches)
        if phase == "save":
            actor.save(ckpt)
        actor.train_step(case.batches)
        after = actor.log_probs(case.batches)
        if after is not None and rank == world - 1:
            torch.save(after, out_path)


def _spawn(fn, case: Case, tp: int, pp: int, port: int, *extra, dp: int = 1) -> object:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        case_path, out_path = Path(tmp) / "case.pt", Path(tmp) / "out.pt"
        torch.save(case, case_path)
        world = tp * pp * dp
        ranks = mp.start_processes(fn, args=(world, tp, pp, port, str(case_path), str(out_path), *extra),
                                   nprocs=world, join=False)
        deadline = time.monotonic() + SPAWN_TIMEOUT_S
        try:
            while not ranks.join(timeout=max(0.0, deadline - time.monotonic())):  # raises when a rank failed
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{fn.__name__}: {world} Megatron ranks (TP={tp}, PP={pp}, DP={dp}) still "
                                       f"running after {SPAWN_TIMEOUT_S:.0f}s")
        finally:
            for process in ranks.processes:
                if process.is_alive():
                    process.kill()
                    process.join(10)
        return torch.load(out_path, weights_only=False)


def megatron_step(case: Case, tp: int, pp: int, port: int = 29531, dp: int = 1) -> dict:
    """The same step by the Megatron backend on tp*pp*dp gloo processes; with dp > 1 every
    data-parallel rank takes the whole batch (so the step must equal the single-rank one: the
    loss normalisation over ranks and the optimizer state sharded across them are what differ)."""
    return _spawn(_worker, case, tp, pp, port, dp=dp)


def resumed_vs_straight(case: Case, tp: int, pp: int, ckpt: str, port: int = 29531) -> dict:
    """Log-probs after two steps in one run, and after one step, a checkpoint, a fresh set of
    processes that load it, and the second step."""
    straight = _spawn(_resume_worker, case, tp, pp, port, ckpt, "straight")
    _spawn(_resume_worker, case, tp, pp, port, ckpt, "save")
    return {"straight": straight, "resumed": _spawn(_resume_worker, case, tp, pp, port, ckpt, "resume")}
