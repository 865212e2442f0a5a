"""The trainer's advantage step in the simulator: OpenRLHF's per-position loop, or OPPO's whole-tensor
version (`train.vectorized_advantages`), charged per padded position of each make_experience
micro-batch (`efficiency.advantage_*_s_per_token`; 0 in the presets: not modelled unless set)."""

from __future__ import annotations

from openrlhf_oppo.sim import costs as cost_model
from openrlhf_oppo.sim import drivers
from openrlhf_oppo.sim.drivers.oppo import OppoDriver
from openrlhf_oppo.sim.presets import load_preset
from openrlhf_oppo.sim.world import World

# OpenRLHF's shuffled micro-batches and advantage loop under OPPO (--oppo.train.*)
PADDED = ["oppo.train.length_buckets=false", "oppo.train.vectorized_advantages=false"]
PER_POSITION = ["efficiency.advantage_loop_s_per_token=0.001", "efficiency.advantage_vectorized_s_per_token=0.0001"]


def test_advantage_seconds_hand_computed():
    cfg = load_preset("cpu-longtail", PER_POSITION)  # micro-batches of 4
    world = World(cfg, cost_model.build(cfg), 0)
    lengths = [10, 900, 20, 30, 800, 40, 50, 60]
    # OpenRLHF's loop over [10 900 20 30] [800 40 50 60]: 900 + 800 positions at 1 ms
    assert abs(world.advantages_s(lengths) - 1.7) < 1e-9
    world.length_buckets = True  # [10 20 30 40] [50 60 800 900]: 40 + 900
    assert abs(world.advantages_s(lengths) - 0.94) < 1e-9
    world.vectorized_advantages = True  # the same positions at 0.1 ms
    assert abs(world.advantages_s(lengths) - 0.094) < 1e-9
    assert World(load_preset("cpu-longtail"), cost_model.build(load_preset("cpu-longtail")), 0).advantages_s(
        lengths) == 0.0  # not modelled


def test_make_experience_carries_the_loop_with_oppos_train_settings_off_and_not_for_oppo():
    costs = {}
    runs = {"sync": ("sync", []), "oppo": ("oppo", []), "padded": ("oppo", PADDED)}
    for sets in ([], PER_POSITION):
        for run, (schedule, settings) in runs.items():
            cfg = load_preset("cpu-longtail", ["workload.seeds=1", *sets, *settings])
            if schedule == "oppo":
                driver = OppoDriver(cfg, cost_model.build(cfg), 0, schedule)
                assert driver.vectorized_advantages is (run == "oppo")
            res = drivers.simulate(cfg, cost_model.build(cfg), schedule, 0)
            spans = [r["t1"] - r["t0"] for r in res.rows
                     if r["kind"] == "span" and r["role"] == "driver" and r["stage"] == "make_experience"]
            costs[run, bool(sets)] = sum(spans) / len(spans)
    added = {run: costs[run, True] - costs[run, False] for run in runs}
    # a straggler-bound step's loop spans hundreds of positions at 1 ms; the whole-tensor one a tenth of it
    assert added["sync"] > 0.2 and added["padded"] > 0.2
    assert 0 < added["oppo"] < 0.2 * added["padded"]
