"""Cost model: seconds for a decode iteration, a prefill call, make_experience, training, a sync.

Built from a preset either by a roofline (hardware x model shape x efficiencies) or
from measured coefficients (`Costs`, e.g. a CPU machine's, written by `python -m oppo_lab
calibrate`). Everything the simulator charges goes through `CostModel`.

Decode (one engine iteration, every running sequence gets one token; memory-bandwidth
bound with a compute floor)::

    step_s(b, ctx) = overhead + max(weights_read + kv_read_per_token * ctx,  compute_per_seq * b)

with ``ctx`` the tokens of context the batch holds (prompt + generated, summed over the
``b`` sequences): the iteration reads every weight once and every cached key/value once.
Prefill (a reward-model call over chunks, each attending to its cached prefix)::

    prefill_s = call + chunks * per_chunk + max(weights_read, per_token * new + per_pair * pairs)

``pairs`` = sum over chunks of new * (prefix + new / 2): query-key pairs of causal attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from openrlhf_oppo.sim import memory
from openrlhf_oppo.sim.presets import ModelShape, SimConfig


@dataclass(frozen=True)
class CostModel:
    """Seconds per unit of work; one engine, one reward server, the whole training pool."""

    decode_overhead_s: float  # per engine iteration, outside the max()
    decode_weights_read_s: float  # reading the actor's weights once (per engine, over its TP devices)
    decode_kv_read_per_token_s: float  # reading one cached token's K and V
    decode_compute_per_seq_s: float  # the compute floor per sequence of the batch
    prefill_call_s: float  # fixed cost of a reward call (launch, gather)
    prefill_weights_read_s: float  # memory floor of a reward forward
    prefill_per_token_s: float  # 2 N flops per new token
    prefill_per_pair_s: float  # 4 L d flops per query-key pair
    prefill_per_chunk_s: float  # bookkeeping per chunk in a call
    forward_per_token_s: float  # one make_experience forward of the actor's size on the training pool
    critic_forward_per_token_s: float  # the critic's forward
    train_per_token_s: float  # actor + critic forward+backward per token on the training pool
    weight_sync_s: float  # one broadcast of the actor's weights to the engines
    phase_overhead_s: float  # per make_experience / train / sync phase
    generate_overhead_s: float  # per generate call
    engines: int  # rollout engines
    scorers: int  # reward servers (0: none)
    scorer_on_engines: bool  # reward servers share the engines' devices (prefill and decode take turns)
    seqs_per_engine: int  # concurrent sequences an engine holds (max_num_seqs, KV capacity)
    decode_slowdown_shared: float
    train_slowdown_shared: float
    reward_forward_per_token_s: float = 0.0  # the reward model's forward on the training pool (split.reward_with_train)
    sleep_transfer_s: float = 0.0  # the hybrid engine (split.sleep): one switch of the devices, vLLM <-> training
    stream_call_s: float = 0.0  # a streamed forward call on the training devices, per model: its ZeRO-3 gather
    ahead_call_s: float = 0.0  # a make_experience call ahead of the batch, per model: its round trip (sim.streamer)
    actor_group_scale: float = 1.0  # split.critic_gpus: pooled devices / the actor's (its forwards and update)
    critic_group_scale: float = 0.0  # pooled devices / the critic's (0: the critic shares the actor's devices)
    critic_train_share: float = 0.0  # the critic's share of the pooled update's flops
    fixed_stage_s: tuple[tuple[str, float], ...] = ()  # (stage, s) added per step: offload (sim.overheads)
    experience_overhead_s: float = 0.0  # per make_experience, beyond phase_overhead_s
    advantage_loop_s_per_token: float = 0.0  # OpenRLHF's advantage loop, per padded position of a micro-batch
    advantage_vectorized_s_per_token: float = 0.0  # OPPO's whole-tensor advantages, the same
    sync_overhead_s: float = 0.0  # per weight sync beyond weight_sync_s: its fixed cost to the trainer (sync_fixed_s)
    sync_gather_s: float = 0.0  # staleness.background_sync: the trainer's share of a sync (that + the gather)
    sharded_sync_s: float = 0.0  # with staleness.background_sync_buffer shards: a background sync's broadcast
    # (no gather; 0: the buffer is gathered, and the background sync takes weight_sync_s as a foreground one)
    decode_slowdown_scoring: float = 0.0  # scorer_on_engines: 0, the engine stops while its scorer prefills; else x

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """One engine iteration with `batch` running sequences holding `context_tokens` in all."""
        memory = self.decode_weights_read_s + self.decode_kv_read_per_token_s * context_tokens
        return self.decode_overhead_s + max(memory, self.decode_compute_per_seq_s * batch)

    def decode_run_s(self, batch: int, context_tokens: int, steps: int) -> float:
        """`steps` iterations of a fixed batch whose context grows by `batch` tokens an iteration:
        the sum of `decode_step_s`, in closed form (the max() switches at most once)."""
        if steps <= 0:
            return 0.0
        kv = self.decode_kv_read_per_token_s
        comp = self.decode_compute_per_seq_s * batch
        mem0 = self.decode_weights_read_s + kv * context_tokens
        slope = kv * batch
        if slope <= 0.0:
            return steps * (self.decode_overhead_s + max(mem0, comp))
        switch = min(steps, max(0, math.ceil((comp - mem0) / slope)))  # first iteration bound by memory
        mem_steps = steps - switch
        mem_sum = mem_steps * mem0 + slope * (steps * (steps - 1) - switch * (switch - 1)) / 2
        return steps * self.decode_overhead_s + switch * comp + mem_sum

    def decode_steps_within(self, batch: int, context_tokens: int, max_steps: int, budget_s: float) -> int:
        """Iterations completed within `budget_s` (at most `max_steps`)."""
        lo, hi = 0, max_steps
        while lo < hi:  # largest k with decode_run_s(k) <= budget
            mid = (lo + hi + 1) // 2
            if self.decode_run_s(batch, context_tokens, mid) <= budget_s + 1e-12:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def prefill_s(self, chunks: list[tuple[int, int]]) -> float:
        """One reward call over `chunks`, each (cached prefix tokens, new tokens)."""
        new = sum(n for _, n in chunks)
        pairs = sum(n * (prefix + n / 2) for prefix, n in chunks)
        compute = self.prefill_per_token_s * new + self.prefill_per_pair_s * pairs
        return self.prefill_call_s + len(chunks) * self.prefill_per_chunk_s + max(self.prefill_weights_read_s, compute)

    def make_experience_s(self, tokens: int, reference: bool, critic: bool, reward: bool = False) -> dict[str, float]:
        """Forwards on the training pool: stage -> seconds (old logprobs, reference, critic values,
        and the reward model's when it is one of the training pool's models)."""
        out = {"old_logprobs": self.forward_per_token_s * tokens}
        if reference:
            out["ref_logprobs"] = self.forward_per_token_s * tokens
        if critic:
            out["values"] = self.critic_forward_per_token_s * tokens
        if reward:
            out["rewards"] = self.reward_forward_per_token_s * tokens
        fixed = dict(self.fixed_stage_s)
        return {stage: s + fixed.get(stage, 0.0) for stage, s in out.items()}

    def train_s(self, tokens: int) -> float:
        return self.train_per_token_s * tokens + dict(self.fixed_stage_s).get("train", 0.0)


def shared_phase_s(compute_s: float, other_s: float, decoding_s: float, slowdown: float) -> float:
    """A phase's seconds on a host it shares with decoding engines: its compute (`compute_s` alone)
    runs ``1 + (slowdown - 1) * f`` slower, ``f`` the share of the phase during which some response
    decodes; decoding goes on for `decoding_s` from the phase's start; `other_s` (overheads) is not
    slowed. With ``k = slowdown - 1`` and ``d = decoding_s`` the span T solves
    ``T = other + compute * (1 + k * min(d, T) / T)``: ``other + compute * (1 + k)`` when d covers
    it, else the positive root of ``T^2 - (other + compute) T - k compute d = 0``. The model the
    lab's calibration fits (`python -m oppo_lab calibrate`, `oppo_lab/sim/fitting.py`)."""
    k = slowdown - 1.0
    d = max(0.0, decoding_s)
    whole = other_s + compute_s * (1.0 + k)
    if k <= 0.0 or d <= 0.0:
        return other_s + compute_s
    if d >= whole:
        return whole
    base = other_s + compute_s
    return (base + math.sqrt(base * base + 4.0 * k * compute_s * d)) / 2.0


def build(cfg: SimConfig) -> CostModel:
    """The cost model of a preset: the roofline, with every measured cost in `cfg.costs` replacing its term."""
    if cfg.hardware is not None and cfg.actor is not None:
        base = _roofline(cfg)
    else:
        base = _measured_only(cfg)
    m = cfg.costs
    updates = {}
    if m.measured_decode:  # a measured engine: no roofline terms left
        updates.update(decode_overhead_s=m.decode_step_s, decode_weights_read_s=0.0,
                       decode_kv_read_per_token_s=m.decode_per_context_token_s,
                       decode_compute_per_seq_s=m.decode_per_seq_s)
    if m.prefill_per_token_s > 0:
        updates.update(prefill_call_s=m.prefill_call_s, prefill_weights_read_s=0.0,
                       prefill_per_token_s=m.prefill_per_token_s, prefill_per_pair_s=0.0)
    if m.forward_per_token_s > 0:
        updates.update(forward_per_token_s=m.forward_per_token_s, critic_forward_per_token_s=m.forward_per_token_s,
                       reward_forward_per_token_s=m.forward_per_token_s)
    if m.train_per_token_s > 0:
        updates["train_per_token_s"] = m.train_per_token_s
    if m.weight_sync_s > 0:
        updates["weight_sync_s"] = m.weight_sync_s
    from openrlhf_oppo.sim import overheads

    model = replace(base, **updates)
    return replace(model, **overheads.updates(cfg, model.train_per_token_s, model.weight_sync_s))


def _layout(cfg: SimConfig) -> dict:
    s = cfg.split
    e = cfg.efficiency
    engines = s.engines
    if s.reward_with_train:
        scorers = 0
    elif s.score_gpus:
        scorers = s.pattern_nodes * s.score_gpus // s.score_tensor_parallel
    else:  # a streaming reward actor beside each engine
        scorers = engines
    sleep = 0.0
    if cfg.hardware is not None and cfg.actor is not None:
        sleep = memory.sleep_transfer_s(cfg)
    return dict(engines=engines, scorers=scorers, scorer_on_engines=s.score_gpus == 0, sleep_transfer_s=sleep,
                phase_overhead_s=e.phase_overhead_s, generate_overhead_s=e.generate_overhead_s,
                experience_overhead_s=e.experience_overhead_s, advantage_loop_s_per_token=e.advantage_loop_s_per_token,
                advantage_vectorized_s_per_token=e.advantage_vectorized_s_per_token,
                sync_overhead_s=sync_fixed_s(cfg),
                decode_slowdown_scoring=e.decode_slowdown_scoring,
                decode_slowdown_shared=e.decode_slowdown_shared, train_slowdown_shared=e.train_slowdown_shared)


def sync_fixed_s(cfg: SimConfig) -> float:
    """The trainer's fixed cost of a weight sync (`efficiency.sync_overhead_s`; -1: `phase_overhead_s`):
    the driver's Ray call on every actor rank and the rank's walk over every parameter (a ZeRO-3 gather
    each, or with `staleness.background_sync_buffer` shards a copy of its partition), beyond the
    transfers' bytes. Every sync's trainer pays it: a foreground sync (OpenRLHF's, and OPPO's without
    `staleness.background_sync`) inside `weight_sync_s`'s wait, a background one before it goes on
    (`sync_gather_s`). Assumed (no GPU run has measured it); a measured preset's is 0, its
    `costs.weight_sync_s` being the whole sync."""
    e = cfg.efficiency
    return e.phase_overhead_s if e.sync_overhead_s < 0 else e.sync_overhead_s


def _measured_only(cfg: SimConfig) -> CostModel:
    e = cfg.efficiency
    return CostModel(stream_call_s=e.phase_overhead_s,  # the measured make_experience phase: gathers, round trips
                     ahead_call_s=e.phase_overhead_s,
                     decode_overhead_s=0.0, decode_weights_read_s=0.0, decode_kv_read_per_token_s=0.0,
                     decode_compute_per_seq_s=0.0, prefill_call_s=0.0, prefill_weights_read_s=0.0,
                     prefill_per_token_s=0.0, prefill_per_pair_s=0.0, prefill_per_chunk_s=e.chunk_overhead_s,
                     forward_per_token_s=0.0, critic_forward_per_token_s=0.0, reward_forward_per_token_s=0.0,
                     train_per_token_s=0.0,
                     weight_sync_s=e.weight_sync_base_s, seqs_per_engine=cfg.workload.max_num_seqs, **_layout(cfg))


def _roofline(cfg: SimConfig) -> CostModel:
    hw = cfg.hardware
    e = cfg.efficiency
    s = cfg.split
    actor = cfg.actor
    reward = cfg.reward or actor
    critic = cfg.critic or reward
    tp = s.tensor_parallel
    bw = hw.hbm_bytes_per_s * e.decode_bandwidth
    train_flops = s.pattern_nodes * (s.train_gpus + s.critic_gpus) * hw.peak_bf16_flops  # pooled; split by `_groups`
    trained_params = actor.params + (critic.params if cfg.workload.critic else 0)
    # per device (a node's network is its devices' NICs): a ZeRO-3 gather over the nodes the DeepSpeed
    # models span; the sync's broadcast from the actor's first rank to the engines on other nodes (colocated:
    # each rank hands the gathered weights to the engine on its own device, CUDA IPC)
    gather = hw.nvlink_bytes_per_s if s.pattern_nodes == 1 else hw.network_bytes_per_s / s.gpus_per_node
    link = hw.nvlink_bytes_per_s if s.nodes == 1 or s.colocate else hw.network_bytes_per_s / s.gpus_per_node
    gather_s = actor.weight_bytes / (gather * e.link_efficiency)
    gather_call_s = e.forward_overhead_s + gather_s  # a call + a ZeRO-3 gather
    # OpenRLHF's sync gathers each parameter (ZeRO-3), then broadcasts it: the two in turn
    broadcast_s = actor.weight_bytes / (link * e.link_efficiency)
    sync_s = e.weight_sync_base_s + gather_s + broadcast_s
    # the trainer's share of a background sync: the sync's fixed cost (`sync_fixed_s`: the call on every
    # rank, its walk over every parameter), as a foreground sync pays it, and the gather; into host memory,
    # each gathered parameter copied to the host beside the next gather; in shards, each rank's copy of its
    # partition, then every engine device takes the whole weights from the actor's ranks, each of which
    # sends its partition to every engine device, both through their links
    buffer = cfg.oppo.staleness.background_sync_buffer
    ranks = s.pattern_nodes * s.train_gpus
    fixed_s = sync_fixed_s(cfg)
    sync_gather_s = fixed_s + gather_s
    sharded_sync_s = 0.0
    if buffer == "host":
        host_copy_s = actor.weight_bytes / (hw.pcie_bytes_per_s * e.link_efficiency)
        sync_gather_s = fixed_s + max(gather_s, host_copy_s)
    elif buffer == "shards":
        sync_gather_s = fixed_s + actor.weight_bytes / (ranks * bw)
        fan_out = max(1.0, s.engines * tp / ranks)  # the senders' links, else the engine devices', bound it
        sharded_sync_s = e.weight_sync_base_s + fan_out * broadcast_s
    return CostModel(
        stream_call_s=gather_call_s,
        ahead_call_s=e.forward_overhead_s,
        decode_overhead_s=e.decode_step_overhead_s,
        decode_weights_read_s=actor.weight_bytes / (tp * bw),
        decode_kv_read_per_token_s=actor.kv_bytes_per_token / (tp * bw),
        decode_compute_per_seq_s=2 * actor.params / (tp * hw.peak_bf16_flops * e.decode_mfu),
        prefill_call_s=e.forward_overhead_s,
        **_prefill_terms(cfg, reward, s.score_tensor_parallel),
        prefill_per_chunk_s=e.chunk_overhead_s,
        forward_per_token_s=2 * actor.params / (train_flops * e.forward_mfu),
        critic_forward_per_token_s=2 * critic.params / (train_flops * e.forward_mfu),
        reward_forward_per_token_s=2 * reward.params / (train_flops * e.forward_mfu),
        train_per_token_s=6 * trained_params / (train_flops * e.train_mfu),
        weight_sync_s=sync_s,
        sync_gather_s=sync_gather_s,
        sharded_sync_s=sharded_sync_s,
        seqs_per_engine=_seqs_per_engine(cfg, actor, tp),
        **_groups(cfg, actor.params, critic.params),
        **_layout(cfg),
    )


def _prefill_terms(cfg: SimConfig, model: ModelShape, tp: int, scorer: bool = True) -> dict:
    """A streaming actor's prefill of `model` over `tp` devices (`scorer`; else a vLLM engine's): its
    memory floor, 2 N flops a new token and 4 L d a query-key pair, the scorer's attention at its own
    utilisation (measured: docs/evidence.md#streamed-prefill-cost)."""
    hw = cfg.hardware
    e = cfg.efficiency
    flops = tp * hw.peak_bf16_flops
    attention = (e.attention_mfu or e.prefill_mfu) if scorer else e.prefill_mfu
    return dict(prefill_weights_read_s=model.weight_bytes / (tp * hw.hbm_bytes_per_s * e.decode_bandwidth),
                prefill_per_token_s=2 * model.params / (flops * e.prefill_mfu),
                prefill_per_pair_s=4 * model.layers * model.hidden / (flops * attention))


def reference_actors(cfg: SimConfig, costs: CostModel) -> CostModel:
    """OPPO's streaming reference actors (`projections.reference_actors`) as reward servers of the
    reference's shape: the streaming reward actor's `prefill_s`, with the actor's shape on one device
    (no tensor parallelism), one actor a `split.reference_gpus` device or, with 0, one beside each
    engine (a prefill pauses it). The log-softmax over the vocabulary is left out (the LM head's
    matmul is in 2 N)."""
    s = cfg.split
    e = cfg.efficiency
    return replace(costs, scorers=s.pattern_nodes * s.reference_gpus or costs.engines,
                   scorer_on_engines=not s.reference_gpus, prefill_call_s=e.forward_overhead_s,
                   prefill_per_chunk_s=e.chunk_overhead_s,
                   **_prefill_terms(cfg, cfg.actor, 1))


def engine_prefill(cfg: SimConfig, costs: CostModel) -> CostModel:
    """A rollout engine's prefill (`prefill_s`): the actor's shape over `split.tensor_parallel`
    devices, as the streaming actors' cost model; with the hybrid engine OPPO's stopped samples pay
    it for prompt + held tokens when they decode on. A measured preset (no hardware) keeps its
    measured prefill terms."""
    if cfg.hardware is None or cfg.actor is None:
        return costs
    e = cfg.efficiency
    return replace(costs, prefill_call_s=e.forward_overhead_s, prefill_per_chunk_s=e.chunk_overhead_s,
                   **_prefill_terms(cfg, cfg.actor, cfg.split.tensor_parallel, scorer=False))


def _groups(cfg: SimConfig, actor_params: int, critic_params: int) -> dict:
    """With the critic on devices of its own: each group's share of the pooled devices."""
    s = cfg.split
    if not s.critic_gpus:
        return {}
    pool = s.train_gpus + s.critic_gpus
    return dict(actor_group_scale=pool / s.train_gpus, critic_group_scale=pool / s.critic_gpus,
                critic_train_share=critic_params / (actor_params + critic_params))


def _seqs_per_engine(cfg: SimConfig, actor: ModelShape, tp: int) -> int:
    """vLLM's max_num_seqs, or fewer when the KV cache cannot hold that many full-length sequences
    (a conservative bound: vLLM would preempt instead)."""
    free = cfg.hardware.hbm_bytes * tp * cfg.workload.kv_cache_fraction - actor.weight_bytes
    if free <= 0:
        raise ValueError(f"--set split.tensor_parallel: the actor's {actor.weight_bytes / 2**30:.0f} GiB of weights do "
                         f"not fit {tp} x {cfg.hardware.name}; raise split.tensor_parallel")
    per_seq = actor.kv_bytes_per_token * (cfg.lengths.prompt_tokens + cfg.lengths.cap_tokens)
    return max(1, min(cfg.workload.max_num_seqs, int(free // per_seq)))
