"""The simulated world of one run: engines, reward servers and training devices, and the
phases every schedule shares. The schedules themselves (`openrlhf_oppo.sim.drivers`)
subclass `World` and decide what to generate and when to train.

A step, after its batch is ready (every schedule)::

    make_experience   reward forward (unless streamed) on the reward servers, in parallel with
                      old-logprob, reference and critic forwards on the training devices (or after
                      them, on the training devices, with `split.reward_with_train` or on a shared host)
    train             actor + critic forward/backward on the training devices
    weight_sync       the actor's weights to the engines (engines pause)

With `split.colocate` the engines pause while the training devices work (they are the
same devices); with `split.sleep` each step also moves vLLM's weights and the DeepSpeed
states out and back over PCIe (`memory.sleep_transfer_s`), before make_experience and
inside the weight sync. A step's time is the gap between consecutive steps' events, after
their weight syncs (`drivers.step_latencies_s`).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from openrlhf_oppo.sim.costs import CostModel, shared_phase_s
from openrlhf_oppo.sim.engine import EventLoop, Recorder, Request, Rollout, Scorer
from openrlhf_oppo.sim.lengths import LengthSampler
from openrlhf_oppo.sim.presets import SimConfig

TRAIN_WORKER = 0  # the training devices draw as one worker per role
STAGE_ROLES = {"old_logprobs": "actor", "ref_logprobs": "ref", "values": "critic", "rewards": "reward"}  # timeline


def padded_tokens(seqs: list[int], micro_batch: int, packing: bool, buckets: bool = False) -> int:
    """Tokens a phase processes for sequences of these lengths: their sum with packing, else each
    micro-batch of `micro_batch` in order padded to its longest (with `buckets`: sorted by length
    first, as OPPO's `train.length_buckets` groups them for training and experience making)."""
    if packing:
        return sum(seqs)
    seqs = sorted(seqs) if buckets else seqs
    return sum(len(seqs[i:i + micro_batch]) * max(seqs[i:i + micro_batch]) for i in range(0, len(seqs), micro_batch))


@dataclass(frozen=True)
class StepRecord:
    """One trained batch."""

    step: int
    generate_start_s: float  # the driver starts waiting for this batch
    batch_ready_s: float
    train_end_s: float
    sync_end_s: float
    prompt_indices: tuple[int, ...]  # trained groups' prompts, sorted
    tokens: int  # response tokens trained
    deferred_fraction: float = 0.0
    delta: int = 0
    chunk_size_tokens: int = 0


@dataclass
class RunResult:
    """What one simulated run produced."""

    schedule: str
    seed: int
    steps: list[StepRecord]
    rows: list[dict]
    # (time, cumulative decoded tokens, cumulative engine iterations) at each train end
    decoded_tokens_at: list[tuple[float, int, int]]
    busy: dict[str, list[tuple[float, float]]]  # role -> busy intervals (all its devices)
    devices: dict[str, int]
    admitted_groups: int = 0
    held_groups: tuple[int, ...] = ()
    trained_group_ids: list[int] = field(default_factory=list)


class World:
    """Resources and shared phases of one run: lengths, engines, reward servers, training devices."""

    def __init__(self, cfg: SimConfig, costs: CostModel, seed: int) -> None:
        self.cfg = cfg
        self.costs = costs
        self.seed = seed
        self.loop = EventLoop()
        self.recorder = Recorder()
        self.rollout = Rollout(self.loop, costs, self.recorder, self.on_progress)
        self.scorer = Scorer(self.loop, costs, self.recorder, self.rollout, self.on_scored,
                             max_call_chunks=cfg.workload.score_chunks_per_call)
        self.sampler = LengthSampler(cfg.lengths, random.Random(seed))
        self._lengths: list[int] = []  # response length by sample index (prompt index * n + j): common random numbers
        self.train_busy: list[tuple[float, float]] = []
        self.records: list[StepRecord] = []
        self.decoded_at: list[tuple[float, int, int]] = []
        self.version = 0  # weight syncs so far
        self.streamer = None  # OPPO's streamed make_experience forwards (sim.streamer), if any
        self.length_buckets = False  # micro-batches grouped by length (OPPO's train.length_buckets)
        # make_experience's old-log-prob forward for stale samples only, fresh ones taking their rollout
        # log-probs (OPPO's train.old_logprobs 'rollout'; an OpenRLHF mode's "same cut" row)
        self.rollout_old_logprobs = False
        self.vectorized_advantages = False  # OPPO's train.vectorized_advantages, else OpenRLHF's loop
        self._issued: tuple[float, list[Request]] = (-1.0, [])  # (time, requests made then): about to decode

    # ----------------------------------------------------------------- hooks (drivers override)

    def on_progress(self, engine: int, crossed: list[Request], finished: list[Request], now_s: float) -> None:
        raise NotImplementedError

    def on_scored(self, items: list[tuple], now_s: float) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------------- shared

    def requests(self, prompt_index: int, sample_ids: tuple[int, ...]) -> list[Request]:
        n = self.cfg.workload.samples_per_group
        need = (prompt_index + 1) * n
        while len(self._lengths) < need:
            self._lengths.append(self.sampler.sample())
        ln = self.cfg.lengths
        out = [Request(sid, ln.prompt_tokens, self._lengths[prompt_index * n + j], ln.cap_tokens)
               for j, sid in enumerate(sample_ids)]
        now = self.loop.now_s
        issued_at, issued = self._issued
        if issued_at == now:  # more requests at the same instant join those
            self._issued = (now, issued + out)
        else:
            self._issued = (now, out)
        return out

    def train_tokens(self, lengths: list[int], buckets: bool = False) -> int:
        """Tokens the training devices process for these responses (`padded_tokens`)."""
        p = self.cfg.lengths.prompt_tokens
        w = self.cfg.workload
        return padded_tokens([p + n for n in lengths], w.micro_batch_size, w.packing, buckets)

    def old_logprobs_left(self, lengths: list[int], fresh: list[bool]) -> dict[str, int]:
        """With `rollout_old_logprobs`: {"old_logprobs": the padded tokens of the samples not `fresh`}, what the
        old-log-prob forward still has to do (`experience_and_train`'s `streamed`); {} without the cut."""
        if not self.rollout_old_logprobs:
            return {}
        stale = [n for n, f in zip(lengths, fresh, strict=True) if not f]
        return {"old_logprobs": self.train_tokens(stale, self.length_buckets) if stale else 0}

    def advantages_s(self, lengths: list[int]) -> float:
        """The trainer's advantage step over make_experience's micro-batches of these responses: a
        cost per padded response position of each micro-batch (OpenRLHF's loop runs one iteration a
        position of its widest response, whatever `workload.packing`)."""
        mb = self.cfg.workload.micro_batch_size
        if self.vectorized_advantages:
            per = self.costs.advantage_vectorized_s_per_token
        else:
            per = self.costs.advantage_loop_s_per_token
        seqs = sorted(lengths) if self.length_buckets else lengths
        return per * sum(max(seqs[i:i + mb]) for i in range(0, len(seqs), mb))

    def experience_and_train(self, now_s: float, lengths: list[int], sample_ids: list[int],
                             score_in_experience: bool, streamed: dict[str, int] | None = None) -> float:
        """make_experience and train from `now_s`; the end of training. Records the spans.
        `streamed`: make_experience stages streamed during generation -> the tokens still to
        forward in them (`sim.streamer`). On a shared host each phase's compute runs slower for
        the share of it during which responses decode (`costs.shared_phase_s`)."""
        c = self.costs
        w = self.cfg.workload
        tokens = self.train_tokens(lengths, self.length_buckets)  # OPPO cuts make_experience's micro-batches alike
        self._hold_engines(now_s)
        decode_end_s = now_s + self._decoding_left_s()
        t = now_s
        streamer = self.streamer
        if streamer is not None:  # a streamed forward in progress holds the devices
            t = max(t, streamer.busy_until_s)
        busy_from = t
        if c.sleep_transfer_s:  # the hybrid engine: vLLM sleeps, the DeepSpeed models come back
            self.recorder.span("driver", 0, "offload", t, t + c.sleep_transfer_s)
            t += c.sleep_transfer_s
        reward = score_in_experience and w.reward_model  # a rule reward: no reward forward anywhere
        on_train = reward and (self.cfg.split.reward_with_train or self.shared_host)
        left = {stage: c.make_experience_s(n, w.reference, w.critic, reward=on_train)[stage]
                for stage, n in (streamed or {}).items()}
        stages = {**c.make_experience_s(tokens, w.reference, w.critic, reward=on_train), **left}
        forwards_s = self._forwards_s(stages)
        fixed_s = c.phase_overhead_s + c.experience_overhead_s + self.advantages_s(lengths)  # the driver's own
        other_s = t - now_s + fixed_s
        slow = self._slowed(forwards_s, other_s, decode_end_s - now_s)
        t = self._forwards(t, {k: dt * slow for k, dt in stages.items()})
        if reward and not on_train:
            t = max(t, self.score_whole(now_s, lengths, sample_ids))
        t += fixed_s
        self.recorder.span("driver", 0, "make_experience", now_s, t)
        train_s = c.train_s(tokens)
        end = self._train(t, train_s * self._slowed(train_s, c.phase_overhead_s, decode_end_s - t))
        self.train_busy.append((busy_from, end))
        self.loop.at(end, self._release_engines, end)
        if streamer is not None:  # the devices train, then send the weights
            streamer.hold(end + self.sync_s())
        return end

    @property
    def shared_host(self) -> bool:
        """Every role on one host's cores (a calibrated CPU preset: not colocated, yet
        `train_slowdown_shared` > 1). The reward forward of make_experience then takes the same
        cores as the other forwards: it is charged among them, as `split.reward_with_train`."""
        return not self.cfg.split.colocate and self.costs.train_slowdown_shared > 1.0

    def _decoding_left_s(self) -> float:
        """On a shared host: how long the engines go on decoding what they hold and the requests
        made this instant (a generate call starting beside this step reaches the engines a moment
        later); 0 elsewhere."""
        if not self.shared_host:
            return 0.0
        now, made = self._issued
        incoming = [r for r in made if r.engine < 0] if now == self.loop.now_s else []
        return self.rollout.drain_s(incoming)

    def _slowed(self, compute_s: float, other_s: float, decoding_s: float) -> float:
        """The factor on a phase's compute beside `decoding_s` more of decoding (1 when none)."""
        if compute_s <= 0.0 or decoding_s <= 0.0:
            return 1.0
        phase_s = shared_phase_s(compute_s, other_s, decoding_s, self.costs.train_slowdown_shared)
        return (phase_s - other_s) / compute_s

    def _forwards_s(self, stages: dict[str, float]) -> float:
        """make_experience's forwards' wall seconds (the critic's group beside the actor's, if any)."""
        c = self.costs
        if not c.critic_group_scale:
            return sum(stages.values())
        actor = sum(s for k, s in stages.items() if k in ("old_logprobs", "ref_logprobs"))
        return max(actor * c.actor_group_scale, (sum(stages.values()) - actor) * c.critic_group_scale)

    def _forwards(self, t: float, stages: dict[str, float]) -> float:
        """make_experience's forwards from `t` (stage -> seconds on the pooled training devices);
        their end. With the critic on devices of its own (`split.critic_gpus`) its group runs
        beside the actor's, each at its share of the devices."""
        c = self.costs
        if c.critic_group_scale:  # (stages, time factor) of each group
            groups = ((("old_logprobs", "ref_logprobs"), c.actor_group_scale),
                      (("values", "rewards"), c.critic_group_scale))
        else:
            groups = ((("old_logprobs", "ref_logprobs", "values", "rewards"), 1.0),)
        end = t
        for names, scale in groups:
            tg = t
            for stage in (n for n in names if n in stages):
                role = STAGE_ROLES[stage]
                self.recorder.span(role, TRAIN_WORKER, stage, tg, tg + stages[stage] * scale)
                tg += stages[stage] * scale
            end = max(end, tg)
        return end

    def _train(self, t: float, train_s: float) -> float:
        """The actor's and critic's updates from `t` (`train_s` on the pooled devices); their end:
        one after the other on shared devices, side by side on their own."""
        c = self.costs
        critic = self.cfg.workload.critic
        if c.critic_group_scale:
            share = c.critic_train_share  # the critic's share of the update
        elif critic:
            share = 0.5
        else:
            share = 0.0
        actor_s = train_s * (1 - share) * c.actor_group_scale  # 1 when the devices are shared
        critic_s = train_s * share * (c.critic_group_scale or 1.0)
        critic_t0 = t if c.critic_group_scale else t + actor_s
        self.recorder.span("actor", TRAIN_WORKER, "train", t, t + actor_s)
        if critic:
            self.recorder.span("critic", TRAIN_WORKER, "train", critic_t0, critic_t0 + critic_s)
        end = max(t + actor_s, critic_t0 + critic_s) + c.phase_overhead_s
        self.recorder.span("driver", 0, "train", t, end)
        return end

    def score_whole(self, now_s: float, lengths: list[int], sample_ids: list[int]) -> float:
        """The reward forward of make_experience over whole sequences, batched per server; its end."""
        n = len(self.scorer.queues)
        per_server: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        for sid, length in zip(sample_ids, lengths, strict=True):
            per_server[sid % n].append((0, self.cfg.lengths.prompt_tokens + length))
        end = now_s
        for q, chunks in enumerate(per_server):
            if chunks:
                dt = self.costs.prefill_s(chunks)
                self.recorder.span("reward", q, "score", now_s, now_s + dt, tokens=sum(x for _, x in chunks))
                self.scorer.busy[q].append((now_s, now_s + dt))
                end = max(end, now_s + dt)
        return end

    def weight_sync(self, now_s: float, background: bool = False) -> float:
        """Broadcast the new weights (`background`: beside the trainer's next step); engines pause for
        it. Returns its end."""
        end = now_s + self.sync_s(background)
        self.rollout.pause(now_s)
        for e in range(len(self.rollout.engines)):
            self.recorder.span("rollout", e, "load_weights", now_s, end)
        self.recorder.span("driver", 0, "weight_sync", now_s, end)
        self.loop.at(end, self._synced, end)
        return end

    def sync_s(self, background: bool = False) -> float:
        """A weight sync's duration (with the hybrid engine, vLLM wakes first; in the background from
        ZeRO-3 partitions, `sharded_sync_s`, without a gather)."""
        c = self.costs
        sync = c.sharded_sync_s if background and c.sharded_sync_s > 0 else c.weight_sync_s
        return c.sleep_transfer_s + sync + c.sync_overhead_s

    def _synced(self, now_s: float) -> None:
        self.version += 1
        self.rollout.resume(now_s)

    def _hold_engines(self, now_s: float) -> None:
        """Training starts: colocated engines pause; on a shared host they slow down."""
        if self.cfg.split.colocate:
            self.rollout.pause(now_s)
        else:
            self.rollout.set_factor(self.costs.decode_slowdown_shared, now_s)

    def _release_engines(self, now_s: float) -> None:
        if self.cfg.split.colocate:
            self.rollout.resume(now_s)
        else:
            self.rollout.set_factor(1.0, now_s)

    def record(self, rec: StepRecord) -> None:
        self.records.append(rec)
        self.decoded_at.append((rec.train_end_s, self.rollout.decoded_tokens, self.rollout.decode_iterations))

    def mean_reward(self, step: int) -> float:
        """Synthetic reward curve: rises as 1 - exp(-step/tau), with seeded noise (drives the adaptive Δ)."""
        w = self.cfg.workload
        noise = random.Random(self.seed * 1_000_003 + step).gauss(0.0, w.reward_noise)
        return 1.0 - math.exp(-step / w.reward_tau_steps) + noise

    def result(self, schedule: str) -> RunResult:
        busy = {"rollout": [iv for e in self.rollout.engines for iv in e.busy],
                "reward": [iv for q in self.scorer.busy for iv in q], "train": self.train_busy}
        devices = {"rollout": len(self.rollout.engines), "reward": len(self.scorer.busy), "train": 1}
        return RunResult(schedule, self.seed, self.records, self.recorder.rows, self.decoded_at, busy, devices)
