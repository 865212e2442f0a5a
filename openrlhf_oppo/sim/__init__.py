"""Simulation: synthetic rollout engines (`synthetic`) and the cluster-scale discrete-event
simulator (`presets`, `costs`, `engine`, `drivers`, `report`, `calibrate`, `cli`), both
driving the real scheduler core. See docs/simulator.md."""
