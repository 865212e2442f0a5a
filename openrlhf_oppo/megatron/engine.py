"""The actor trained by Megatron-Core: action log-probs and a PPO step with OpenRLHF's losses.

One `MegatronActor` per training rank, after `parallel.initialize`. It takes what OpenRLHF's
actor takes from an `Experience` (sequences left-padded prompt + right-padded response, the
attention mask, the action mask, old/reference log-probs, advantages) as a list of
micro-batches, runs them through `get_forward_backward_func` (one pipeline schedule for every
PP size), and computes log-probs like `openrlhf.models.Actor` (positions from the attention
mask, logits in fp32 divided by the temperature) but over vocabulary-parallel logits
(`tensor_parallel.vocab_parallel_cross_entropy`). The loss is OpenRLHF's `PolicyLoss` plus,
with `kl_coef` > 0, its KL loss (`compute_approx_kl`, `aggregate_loss`), normalised as
OpenRLHF 0.11.2 normalises a DeepSpeed step (`loss_utils._optimizer_step_loss_norm`: one token
mean over all the step's micro-batches and data-parallel ranks; Megatron's schedule divides by
the number of micro-batches as DeepSpeed divides by its accumulation steps). Gradients go
through Megatron's DDP and distributed optimizer (Adam with decoupled weight decay, gradient
clipping).

OpenRLHF hands its experiences over on the CPU; `_run`, the one way into the model, moves each
micro-batch once onto the device of the weights (`MicroBatch.to`), where DDP put them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from openrlhf_oppo.megatron import model as mmodel


@dataclass
class MicroBatch:
    sequences: torch.Tensor  # (b, s) token ids
    attention_mask: torch.Tensor  # (b, s) 1 = token, 0 = padding
    action_mask: torch.Tensor  # (b, a) over the last a positions' next tokens
    old_log_probs: torch.Tensor | None = None  # (b, a)
    advantages: torch.Tensor | None = None  # (b, a)
    base_log_probs: torch.Tensor | None = None  # (b, a), the reference model's (KL loss)
    rollout_log_probs: torch.Tensor | None = None  # (b, a), vLLM's (importance-sampling correction)

    def to(self, device: torch.device, non_blocking: bool = False) -> MicroBatch:
        """The same batch with every tensor on `device` (`Tensor.to`: a tensor already there is
        kept, not copied). From pageable host memory a `non_blocking` copy is a synchronous one; from
        pinned memory it overlaps, and the stream orders it before the kernels that read it."""
        moved = {}
        for f in dataclasses.fields(self):
            t = getattr(self, f.name)
            if t is not None:
                moved[f.name] = t.to(device, non_blocking=non_blocking)
        return dataclasses.replace(self, **moved)

    def left_padded(self, length: int, pad_id: int) -> MicroBatch:
        """The same batch left-padded to `length` (pipeline stages exchange one tensor shape)."""
        extra = length - self.sequences.shape[1]
        if extra < 0:
            raise ValueError(f"a micro-batch of {self.sequences.shape[1]} tokens does not fit {length}")
        if extra == 0:
            return self
        seq = torch.nn.functional.pad(self.sequences, (extra, 0), value=pad_id)
        mask = torch.nn.functional.pad(self.attention_mask, (extra, 0), value=0)
        return dataclasses.replace(self, sequences=seq, attention_mask=mask)


@dataclass
class Settings:
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    temperature: float = 1.0
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0
    kl_estimator: str = "k1"
    kl_unbiased_gradient: bool = False
    dtype: torch.dtype = torch.float32
    pad_id: int = 0
    loss_kwargs: dict = field(default_factory=dict)  # more PolicyLoss arguments


def _inputs(mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input ids, positions as `openrlhf.models.Actor` makes them, and Megatron's boolean mask
    (True = not attended: causal, or a padding key)."""
    mask = mb.attention_mask
    positions = mask.long().cumsum(-1) - 1
    positions.masked_fill_(mask == 0, 1)
    s = mask.shape[1]
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=mask.device), 1)
    blocked = causal[None, None] | (mask == 0)[:, None, None, :]
    return mb.sequences, positions, blocked


def action_log_probs(logits: torch.Tensor, mb: MicroBatch, temperature: float) -> torch.Tensor:
    """Log-probs of the action tokens from this rank's vocabulary shard of the logits (b, s, v/tp)."""
    from megatron.core import tensor_parallel

    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    target = torch.roll(mb.sequences, shifts=-1, dims=1)
    log_probs = -tensor_parallel.vocab_parallel_cross_entropy(logits, target)[:, :-1]
    return log_probs[:, -mb.action_mask.shape[1]:] * mb.action_mask.float()


class MegatronActor:
    """This rank's shard of the actor with its DDP wrapper and distributed optimizer."""

    def __init__(self, hf_config, hf_state: Mapping[str, torch.Tensor], settings: Settings):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from openrlhf.models.loss import PolicyLoss

        self.settings = settings
        self.shape = mmodel.Shape.of(hf_config)
        module = mmodel.build(self.shape, settings.dtype)
        mmodel.load_hf(module, hf_state, self.shape)
        self.model = DistributedDataParallel(
            config=module.config, module=module,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True))
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=settings.lr, min_lr=settings.lr, weight_decay=settings.weight_decay,
                            adam_beta1=settings.betas[0], adam_beta2=settings.betas[1], adam_eps=settings.eps,
                            clip_grad=settings.clip_grad, bf16=settings.dtype == torch.bfloat16,
                            params_dtype=settings.dtype, use_distributed_optimizer=True),
            [self.model])
        self.policy_loss = PolicyLoss(settings.clip_eps_low, settings.clip_eps_high, **settings.loss_kwargs)

    @property
    def device(self) -> torch.device:
        """Where this rank's weights are: Megatron's DDP put them in buffers on
        `torch.cuda.current_device()` (the CPU under `compat.megatron_cpu`)."""
        return next(self.model.parameters()).device

    def _run(self, batches: list[MicroBatch], loss_of, forward_only: bool) -> list[dict]:
        """Megatron's schedule over `batches`, each moved here, once, onto the weights' device
        (OpenRLHF hands over its experiences on the CPU): every tensor the forward and the loss
        read, and every tensor they make from those, is on that device."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        device = self.device
        length = max(mb.sequences.shape[1] for mb in batches)
        padded = [mb.to(device, non_blocking=True).left_padded(length, self.settings.pad_id) for mb in batches]
        sizes = {mb.sequences.shape[0] for mb in padded}
        if len(sizes) != 1:
            raise ValueError(f"the Megatron backend needs micro-batches of one size, got {sorted(sizes)}")
        it = iter(padded)

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            ids, positions, blocked = _inputs(mb)
            return model(ids, positions, blocked), lambda logits: loss_of(logits, mb)

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=it, model=[self.model], num_microbatches=len(padded),
            seq_length=length, micro_batch_size=sizes.pop(), forward_only=forward_only)

    def log_probs(self, batches: list[MicroBatch]) -> list[torch.Tensor] | None:
        """Each micro-batch's action log-probs, on the last pipeline stage (None on the others)."""
        from megatron.core import parallel_state as ps

        def loss_of(logits, mb):
            lp = action_log_probs(logits, mb, self.settings.temperature)
            return lp.sum() * 0, {"log_probs": lp.detach()}

        self.model.eval()
        with torch.no_grad():
            out = self._run(batches, loss_of, forward_only=True)
        return [o["log_probs"] for o in out] if ps.is_pipeline_last_stage() else None

    def _loss(self, logits: torch.Tensor, mb: MicroBatch, norm: dict) -> tuple[torch.Tensor, dict]:
        from openrlhf.models.loss import aggregate_loss
        from openrlhf.models.utils import compute_approx_kl

        lp = action_log_probs(logits, mb, self.settings.temperature)
        loss, clip_ratio, ppo_kl, _, _ = self.policy_loss(lp, mb.old_log_probs, mb.advantages,
                                                          action_mask=mb.action_mask,
                                                          rollout_log_probs=mb.rollout_log_probs, **norm)
        stats = {"policy_loss": loss.detach(), "ppo_clip_ratio": clip_ratio.detach(), "ppo_kl": ppo_kl.detach()}
        if self.settings.kl_coef > 0:
            kl = compute_approx_kl(lp, mb.base_log_probs, log_probs_old=mb.old_log_probs,
                                   kl_estimator=self.settings.kl_estimator,
                                   unbiased_gradient=self.settings.kl_unbiased_gradient)
            kl_loss = aggregate_loss(kl, mb.action_mask, **norm)
            stats["kl"] = kl_loss.detach()
            loss = loss + kl_loss * self.settings.kl_coef
        return loss, stats

    def _step_norm(self, batches: list[MicroBatch]) -> dict:
        """OpenRLHF's loss normalisers for one optimizer step over `batches`, summed over the
        data-parallel ranks (a collective). OpenRLHF moves the masks to
        `torch.cuda.current_device()` where CUDA is present: the device DDP put the weights on."""
        from megatron.core import parallel_state as ps
        from openrlhf.utils.loss_utils import _optimizer_step_loss_norm

        return _optimizer_step_loss_norm([mb.action_mask for mb in batches], ps.get_data_parallel_group(),
                                         ps.get_data_parallel_world_size(), len(batches))

    def train_step(self, batches: list[MicroBatch]) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches (gradients accumulated): the mean of
        the micro-batches' statistics (for the losses, the step's token mean: each micro-batch's
        loss is its share times their number) on the last pipeline stage ({} on the others),
        and the gradient norm."""
        from megatron.core import parallel_state as ps

        norm = self._step_norm(batches)
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        out = self._run(batches, lambda logits, mb: self._loss(logits, mb, norm), forward_only=False)
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise FloatingPointError("the Megatron optimizer skipped its step (non-finite gradients)")
        stats = {}
        if ps.is_pipeline_last_stage():
            stats = {k: float(torch.stack([o[k] for o in out]).mean()) for k in out[0]}
        stats["grad_norm"] = float(grad_norm)
        return stats

    def _files(self, ckpt: Path) -> tuple[Path, Path, Path]:
        from megatron.core import parallel_state as ps

        tag = f"tp{ps.get_tensor_model_parallel_rank()}_pp{ps.get_pipeline_model_parallel_rank()}"
        return ckpt / f"model_{tag}.pt", ckpt / f"optimizer_{tag}.pt", ckpt / f"params_{tag}.pt"

    def _layout(self) -> dict:
        from megatron.core import parallel_state as ps

        return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
                "layers": self.shape.layers, "hidden": self.shape.hidden, "vocab": self.shape.vocab}

    def save(self, ckpt: str | Path) -> None:
        """A checkpoint of this actor (a collective): each tensor/pipeline shard's weights and
        optimizer state from data-parallel rank 0 (the distributed optimizer's moments and fp32
        main weights gathered there), and `layout.json`, which a resume must match."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        ckpt = Path(ckpt)
        ckpt.mkdir(parents=True, exist_ok=True)
        model_file, optim_file, params_file = self._files(ckpt)
        self.optimizer.save_parameter_state(str(params_file))  # a collective over data-parallel ranks
        if ps.get_data_parallel_rank() == 0:
            torch.save(self.model.module.state_dict(), model_file)
            torch.save(self.optimizer.state_dict(), optim_file)
        if dist.get_rank() == 0:
            (ckpt / "layout.json").write_text(json.dumps(self._layout()))
        dist.barrier()

    def load(self, ckpt: str | Path) -> None:
        """Resume from `save`'s checkpoint, saved with the same TP/PP layout and model."""
        ckpt = Path(ckpt)
        layout_file = ckpt / "layout.json"
        if not layout_file.is_file():
            raise FileNotFoundError(f"{ckpt} holds no Megatron checkpoint (no layout.json)")
        saved, now = json.loads(layout_file.read_text()), self._layout()
        if saved != now:
            raise ValueError(f"the checkpoint {ckpt} was saved with {saved}; this run has {now}: "
                             "resume with the same tensor- and pipeline-parallel sizes and model")
        model_file, optim_file, params_file = self._files(ckpt)
        self.model.module.load_state_dict(torch.load(model_file, weights_only=True))
        self.optimizer.load_state_dict(torch.load(optim_file, weights_only=False))
        with torch.no_grad():  # fp32 main weights are views of the model's: copied in place
            self._load_parameter_state(str(params_file))

    def _load_parameter_state(self, path: str) -> None:
        """Two gaps of megatron-core 0.16.1 with torch's AdamW (no Transformer Engine, no apex):
        `load_state_dict` gives every parameter's state the same "step" tensor, which AdamW then
        increments once per parameter (every bias correction after a resume would be wrong), so
        each gets its own; and the saved parameter state holds no "step" while
        `_set_main_param_and_optimizer_states` copies every key of the live state, so the live
        step is kept."""
        chained = self.optimizer.chained_optimizers
        for opt in chained:
            for state in opt.optimizer.state.values():
                if "step" in state:
                    state["step"] = state["step"].clone()
            original = opt._set_main_param_and_optimizer_states

            def keep_step(model_param, tensors, _opt=opt, _original=original):
                group, order = _opt.model_param_group_index_map[model_param]
                live = _opt.optimizer.state[_opt.optimizer.param_groups[group]["params"][order]]
                if "step" in live and "step" not in tensors:
                    tensors = {**tensors, "step": live["step"]}
                _original(model_param, tensors)

            opt._set_main_param_and_optimizer_states = keep_step
        try:
            self.optimizer.load_parameter_state(path)
        finally:
            for opt in chained:
                del opt._set_main_param_and_optimizer_states
