"""OpenRLHF's policy actor trained by Megatron-Core (`--oppo.megatron.enable`).

`MegatronPolicyModelActor` stands where OpenRLHF 0.11.2's `PolicyModelActor` stands (the
driver swaps the name before `train_ppo_ray.train` builds the actor group) and answers the
calls OpenRLHF's trainer and experience maker make of it: `init_model_from_pretrained`,
`forward` (old log-probs), `append` and `fit` (the PPO update), `broadcast_to_vllm`,
`save_checkpoint` / `get_checkpoint_states` and `save_model`.

The actor group's ranks (`--actor.num_nodes x --actor.num_gpus_per_node`) form Megatron's
tensor x pipeline x data parallel groups. OpenRLHF hands every rank its own chunk of a batch
(`RayActorGroup.async_run_method_batch`, no duplicates: `--ds.tensor_parallel_size` is 1), so
`execute_batch` first gathers the chunks of its model-parallel group: every rank of that group
then runs the same forwards (they are collectives) and answers for its own chunk, and the
group's data-parallel rank trains on the union of its ranks' chunks.
"""

from __future__ import annotations

import os
from pathlib import Path

import ray
import torch
from openrlhf.trainer.ray.launcher import BaseModelActor

from openrlhf_oppo import timeline
from openrlhf_oppo.compat.megatron_cpu import on_cpu

CKPT_DIR = "_actor"  # under --ckpt.path, where OpenRLHF's DeepSpeed actor keeps its checkpoints
LATEST = "latest"  # names the newest checkpoint's tag, as DeepSpeed's file of that name does
CLIENT_STATES = "client_states.pt"  # the trainer's state (steps, data loader, OPPO's carried groups)


class MegatronPolicyModelActor(BaseModelActor):
    def init_model_from_pretrained(self, strategy, pretrain: str, max_steps: int | None = None, vllm_engines=None):
        from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer
        from openrlhf.utils import get_tokenizer
        from transformers import AutoConfig

        from openrlhf_oppo.integrations.runtime.run_config import config_from_env
        from openrlhf_oppo.megatron import parallel
        from openrlhf_oppo.megatron.engine import MegatronActor
        from openrlhf_oppo.megatron.model import SafetensorsWeights

        self._setup_distributed(strategy)  # torch.distributed over the group's ranks
        args = self.args = strategy.args
        self.vllm_engines = vllm_engines
        self.megatron = config_from_env().megatron
        self.hf_config = AutoConfig.from_pretrained(pretrain)
        self.tokenizer = get_tokenizer(pretrain, None, "left", strategy, use_fast=not args.data.disable_fast_tokenizer)
        with on_cpu():
            parallel.initialize(self.megatron.tensor_parallel_size, self.megatron.pipeline_parallel_size,
                                seed=args.train.seed)
            self.actor = MegatronActor(self.hf_config, SafetensorsWeights(pretrain), _settings(args, self.tokenizer))
        self.scheduler = _lr_schedule(args, max_steps)
        self.buffer = NaiveReplayBuffer(args.train.micro_batch_size, 0, True, False, False)
        self.checkpoint_states = {}
        root = Path(args.ckpt.path) / CKPT_DIR
        if args.ckpt.load_enable and (root / LATEST).is_file():
            tag = (root / LATEST).read_text().strip()
            strategy.print(f"Loading the Megatron checkpoint: {root / tag}")
            with on_cpu():
                self.actor.load(root / tag)
            self.checkpoint_states = torch.load(root / tag / CLIENT_STATES, weights_only=False)
            for _ in range(self.checkpoint_states.get("optimizer_steps", 0)):
                self.scheduler.step()
        if vllm_engines is not None and torch.distributed.get_rank() == 0:
            from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

            ActorPPOTrainer._init_vllm_sync_group(self, getattr(args.vllm, "sync_backend", "nccl"))

    # ------------------------------------------------------------------ batches from OpenRLHF

    def execute_batch(self, method_name: str, all_data, start_idx, end_idx):
        """OpenRLHF's per-rank batch call (`forward` or `append`) for the whole model-parallel
        group: the group's chunks are gathered, in rank order, on each of its ranks."""
        from megatron.core import parallel_state as ps

        if method_name not in ("forward", "append"):
            raise ValueError(f"the Megatron actor batches `forward` and `append`, not {method_name!r}")
        mine = {key: value[start_idx:end_idx] for key, value in all_data.items()}
        group = ps.get_model_parallel_group()
        chunks = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(chunks, mine, group=group)
        sizes = [len(next(iter(chunk.values()))) for chunk in chunks]
        method = getattr(self, method_name)
        results = [method(**{key: chunk[key][i] for key in chunk}) for chunk, n in zip(chunks, sizes) for i in range(n)]
        rank = torch.distributed.get_rank(group)
        offset = sum(sizes[:rank])
        return results[offset:offset + sizes[rank]]

    def forward(self, sequences, action_mask, attention_mask, packed_seq_lens=None, mm_train_inputs_list=None):
        """The action log-probs of one batch (a collective of the model-parallel group); a text
        model's, as OpenRLHF's actor ignores multimodal inputs for one."""
        from openrlhf_oppo.megatron.engine import MicroBatch

        mb = MicroBatch(sequences, attention_mask, action_mask.bool())
        with timeline.RECORDER.timed("actor", "old_logprobs"), on_cpu():
            out = self.actor.log_probs([mb])
            return _from_last_stage(out[0] if out else None, tuple(action_mask.shape))

    def append(self, experience) -> None:
        self.buffer.append(experience)

    # ------------------------------------------------------------------ the PPO update

    def fit(self, kl_ctl: float = 0) -> dict:
        """OpenRLHF's `ppo_train` over the buffer: `--train.max_epochs` passes, micro-batches
        of `--train.micro_batch_size` in a shuffled order (one order on every rank of the
        model-parallel group), one optimizer step per `--train.batch_size` samples over the
        data-parallel ranks; the statistics OpenRLHF's actor returns."""
        from megatron.core import parallel_state as ps

        args = self.args
        self.actor.settings.kl_coef = kl_ctl if args.algo.kl.use_loss else 0.0
        items = self.buffer.items
        # one order on every rank of the model-parallel group, a new one each pass and step
        shuffle = torch.Generator().manual_seed(args.train.seed + self.scheduler.last_epoch)
        mbs = args.train.micro_batch_size
        accumulation = max(1, args.train.batch_size // (mbs * ps.get_data_parallel_world_size()))
        steps = []
        with timeline.RECORDER.timed("actor", "train"), on_cpu():
            for _ in range(args.train.max_epochs):
                shuffled = [items[i] for i in torch.randperm(len(items), generator=shuffle).tolist()]
                batches = [_micro_batch(self.buffer.collate_fn(shuffled[i:i + mbs]))
                           for i in range(0, len(shuffled) - mbs + 1, mbs)]
                for i in range(0, len(batches), accumulation):
                    lr = self.scheduler.get_last_lr()[0]
                    for group in self.actor.optimizer.param_groups:
                        group["lr"] = lr
                    steps.append(self.actor.train_step(batches[i:i + accumulation]))
                    self.scheduler.step()
            trained = _from_last_stage_object(_mean(steps))
        status = _dp_mean({**_info_means(items), **trained})  # the update's kl, as OpenRLHF's actor reports it
        status["actor_lr"] = self.scheduler.get_last_lr()[0]
        if "grad_norm" in status:
            status["actor_grad_norm"] = status.pop("grad_norm")
        self.buffer.clear()
        return status

    # ------------------------------------------------------------------ weights out

    def broadcast_to_vllm(self) -> None:
        """The weights under Hugging Face names, gathered from the shards, into the engines:
        on a CPU host as OPPO's CPU sync sends them, on GPUs through OpenRLHF's NCCL group."""
        from openrlhf_oppo.megatron import export

        with timeline.RECORDER.timed("actor", "weight_sync"), on_cpu():
            named = export.hf_weights(self.actor.model.module, self.actor.shape)
            if not torch.cuda.is_available():
                from openrlhf_oppo.compat.weight_sync import send_weights

                send_weights(self, named)
                return
            self._broadcast(named, export.weight_count(self.actor.shape))

    def _broadcast(self, named, total: int) -> None:
        """OpenRLHF 0.11.2's `_broadcast_param` for each gathered weight (global rank 0 sends)."""
        rank0 = torch.distributed.get_rank() == 0
        for count, (name, tensor) in enumerate(named, 1):
            if not rank0:
                continue
            refs = [engine.update_weight.remote(name, dtype=tensor.dtype, shape=tensor.shape,
                                                empty_cache=count == total) for engine in self.vllm_engines]
            self._model_update_group.broadcast(tensor, src=0, stream=torch.cuda.current_stream())
            ray.get(refs)
        torch.distributed.barrier()

    def save_model(self) -> None:
        """The trained actor as a Hugging Face checkpoint in --ckpt.output_dir (with its tokenizer)."""
        self._save_hf(self.args.ckpt.output_dir)

    def _save_hf(self, out_dir: str) -> None:
        from openrlhf_oppo.megatron import export

        with on_cpu():
            export.save_hf(self.actor.model.module, self.actor.shape, self.hf_config, out_dir)
        if torch.distributed.get_rank() == 0:
            self.tokenizer.save_pretrained(out_dir)

    def save_checkpoint(self, tag, client_states=None, metric_value=None, metric_key=None) -> None:
        """The Megatron shards and optimizer state under --ckpt.path/_actor/<tag>, with the
        trainer's `client_states` (OPPO's carried groups among them); `latest` names it once
        every rank has written; the oldest beyond --ckpt.max_num are removed."""
        import shutil

        root = Path(self.args.ckpt.path) / CKPT_DIR
        with on_cpu():
            self.actor.save(root / tag)
        if torch.distributed.get_rank() == 0:
            states = {**(client_states or {}), "optimizer_steps": self.scheduler.last_epoch}
            torch.save(states, root / tag / CLIENT_STATES)
            (root / LATEST).write_text(tag)
            tags = sorted((d for d in root.iterdir() if (d / CLIENT_STATES).is_file()), key=os.path.getmtime)
            for old in tags[:max(0, len(tags) - self.args.ckpt.max_num)]:
                shutil.rmtree(old)
        torch.distributed.barrier()
        if self.args.ckpt.save_hf:
            self._save_hf(os.path.join(self.args.ckpt.path, f"{tag}_hf"))

    def get_checkpoint_states(self) -> dict:
        return self.checkpoint_states

    def reload_states(self) -> None:
        raise NotImplementedError("the Megatron actor has no sleep mode (--ds.enable_sleep is refused at launch)")

    offload_states = reload_states


MegatronPolicyModelRayActor = ray.remote(num_gpus=1)(MegatronPolicyModelActor)


def _settings(args, tokenizer):
    from openrlhf_oppo.megatron.engine import Settings

    adam = args.actor.adam
    low, high = args.actor.eps_clip_low_high
    correction = args.algo.advantage
    return Settings(
        lr=adam.lr, betas=tuple(adam.betas), eps=adam.eps, weight_decay=adam.weight_decay,
        clip_grad=args.actor.max_norm, temperature=args.rollout.temperature, clip_eps_low=low, clip_eps_high=high,
        kl_estimator=args.algo.kl.estimator, kl_unbiased_gradient=args.algo.kl.unbiased_gradient,
        dtype={"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.ds.param_dtype, torch.float32),
        pad_id=tokenizer.pad_token_id,
        loss_kwargs=dict(dual_clip=args.actor.dual_clip, token_level_loss=args.actor.loss_agg_mode == "token-mean",
                         policy_loss_type=args.actor.policy_loss_type,
                         is_correction_level=correction.is_correction_level,
                         is_correction_mode=correction.is_correction_mode,
                         is_correction_gating=correction.is_correction_gating,
                         is_correction_threshold=correction.is_correction_threshold))


def _lr_schedule(args, max_steps: int | None):
    """OpenRLHF's learning-rate schedule (`DeepspeedStrategy`'s `get_scheduler` call), stepped on a
    stand-in optimizer; `fit` copies its rate into Megatron's parameter groups before each step."""
    import math

    from transformers.trainer import get_scheduler

    name = args.actor.lr_scheduler
    steps = max_steps or 1
    with_min = name in {"cosine_with_min_lr", "cosine_warmup_with_min_lr"}
    extra = {"min_lr_rate": args.actor.min_lr_ratio} if with_min else {}
    stand_in = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=args.actor.adam.lr)
    return get_scheduler(name, stand_in, num_warmup_steps=math.ceil(steps * args.actor.lr_warmup_ratio),
                         num_training_steps=steps, scheduler_specific_kwargs=extra)


def _micro_batch(exp):
    from openrlhf_oppo.megatron.engine import MicroBatch

    return MicroBatch(exp.sequences, exp.attention_mask, exp.action_mask.bool(), exp.action_log_probs,
                      exp.advantages, exp.base_action_log_probs, exp.rollout_log_probs)


def _mean(steps: list[dict]) -> dict:
    """The mean of each statistic over the optimizer steps (every step of a rank has the same keys)."""
    return {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]} if steps else {}


def _device() -> str:
    """Where a collective's tensor must be: NCCL takes CUDA tensors, gloo CPU ones."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _info_means(items) -> dict:
    """Each per-sample statistic of the experiences (reward, response length, ...), averaged
    over this rank's samples (then over the data-parallel ranks, by `_dp_mean`)."""
    sums: dict[str, float] = {}
    for item in items:
        for key, value in item.info.items():
            if isinstance(value, torch.Tensor):
                sums[key] = sums.get(key, 0.0) + float(value.float().mean())
    return {key: total / max(1, len(items)) for key, total in sums.items()}


def _dp_mean(stats: dict) -> dict:
    """The mean over the data-parallel ranks of each rank's statistics (the same keys on every
    rank). A rank's loss is its tokens' share of the step's token mean times the data-parallel
    size (OpenRLHF's normalisation), so this mean is the step's token mean."""
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_world_size()
    if dp == 1:
        return stats
    keys = sorted(stats)
    values = torch.tensor([stats[k] for k in keys], dtype=torch.float64, device=_device())
    torch.distributed.all_reduce(values, group=ps.get_data_parallel_group())
    return dict(zip(keys, (values / dp).tolist(), strict=True))


def _pipeline_last_rank() -> int:
    from megatron.core import parallel_state as ps

    return torch.distributed.get_process_group_ranks(ps.get_pipeline_model_parallel_group())[-1]


def _from_last_stage(t: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor the last pipeline stage computed, on every stage."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return t.float().cpu()
    if t is None:
        t = torch.empty(shape, dtype=torch.float32, device=_device())
    t = t.float().contiguous()
    torch.distributed.broadcast(t, src=_pipeline_last_rank(), group=ps.get_pipeline_model_parallel_group())
    return t.cpu()


def _from_last_stage_object(obj: dict) -> dict:
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return obj
    box = [obj]
    group = ps.get_pipeline_model_parallel_group()
    torch.distributed.broadcast_object_list(box, src=_pipeline_last_rank(), group=group)
    return box[0]
