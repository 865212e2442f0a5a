"""The GPU split of a simulator preset (`split:`): which devices generate, score and train."""

from __future__ import annotations

from dataclasses import dataclass

from openrlhf_oppo.settings import setting as _f


@dataclass(frozen=True)
class Split:
    """Which devices generate, score and train (per node; the pattern repeats on every node but
    `engine_nodes`, which hold engines only)."""

    nodes: int = _f(1, "Nodes.")
    gpus_per_node: int = _f(8, "Devices per node.")
    generate_gpus: int = _f(7, "Devices per node running rollout engines.")
    score_gpus: int = _f(1, "Devices per node running the reward model (0: on the generate devices, "
                            "where prefill and decode take turns).")
    train_gpus: int = _f(7, "Devices per node training actor and critic and running the reference, "
                            "critic and old-logprob forwards.")
    colocate: bool = _f(True, "Training devices are the generate devices: decoding and training take turns.")
    tensor_parallel: int = _f(1, "Devices per rollout engine.")
    score_tensor_parallel: int = _f(1, "Devices per reward-model server.")
    sleep: bool = _f(False, "Colocated only: OpenRLHF's hybrid engine (`--vllm.enable_sleep --ds.enable_sleep`): "
                            "vLLM and the DeepSpeed models take the devices' memory in turn, moving their state "
                            "over PCIe each step.")
    critic_gpus: int = _f(0, "Devices per node for the critic apart from the actor's (OpenRLHF without "
                             "--train.colocate_all: a group of its own, or with the reward model under "
                             "--train.colocate_critic_reward); 0: it shares the training devices.")
    reward_with_train: bool = _f(False, "The reward model is one of the DeepSpeed models on the training devices "
                                        "(OpenRLHF's colocated models): its forward runs in make_experience, after "
                                        "the others (needs score_gpus 0).")
    reference_gpus: int = _f(0, "Devices per node of OPPO's streaming reference actors "
                                "(`projections.reference_actors`), each holding the whole reference model; 0: one "
                                "beside each engine (a prefill pauses its engine). Only a schedule that streams "
                                "into them can use devices of their own.")
    engine_nodes: int = _f(0, "Nodes of rollout engines only, every device an engine's (TP within the node), "
                              "apart from the pattern above, which repeats on the other nodes (its generate_gpus "
                              "may then be 0): OpenRLHF's multi-node layout with vLLM on nodes of its own "
                              "(--vllm.num_engines x --vllm.tensor_parallel_size on them, --actor.num_nodes the "
                              "rest). Split layouts only.")

    @property
    def devices_used(self) -> int:
        """Devices of a node the split uses: vLLM's and the reward model's, and the DeepSpeed models'
        unless they share vLLM's."""
        return (self.generate_gpus + self.score_gpus + self.reference_gpus
                + (0 if self.colocate else self.train_gpus + self.critic_gpus))

    @property
    def pattern_nodes(self) -> int:
        """Nodes the per-node pattern repeats on (all but `engine_nodes`): where the DeepSpeed models,
        reward devices and reference devices are."""
        return self.nodes - self.engine_nodes

    @property
    def engines(self) -> int:
        """Rollout engines: those of the engine nodes and of the pattern's generate devices."""
        per_node = self.gpus_per_node // self.tensor_parallel, self.generate_gpus // self.tensor_parallel
        return self.engine_nodes * per_node[0] + self.pattern_nodes * per_node[1]

    @property
    def devices(self) -> int:
        """Devices the layout uses over all nodes."""
        return self.engine_nodes * self.gpus_per_node + self.pattern_nodes * self.devices_used
