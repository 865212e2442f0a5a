"""Simulation: synthetic rollout engines that drive the real scheduler core."""
