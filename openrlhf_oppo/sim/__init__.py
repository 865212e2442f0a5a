"""Simulation: the cluster-scale discrete-event simulator (`presets`, `costs`, `engine`,
`drivers`, `report`, `calibrate`, `cli`), driving the real scheduler core. The synthetic
rollout engine it shares with the benchmarks is `openrlhf_oppo.bench.synthetic`. See
docs/simulator.md."""
