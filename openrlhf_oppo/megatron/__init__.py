"""The Megatron-Core training backend: tensor and pipeline parallel training of the actor
(and critic) from a Hugging Face checkpoint, with OpenRLHF's PPO losses."""
