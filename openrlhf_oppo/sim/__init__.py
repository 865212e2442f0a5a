"""Simulation: the cluster-scale discrete-event simulator (`presets`, `costs`, `engine`,
`drivers`, `layouts`, `report`, `cli`), driving the real scheduler core: what a schedule's step
costs on a cluster's GPUs before it is rented. Its calibration and validation are the lab's
(`oppo_lab/sim`). See docs/design.md."""
