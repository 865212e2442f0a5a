"""`openrlhf-oppo plot timeline` on hand-built runs: step numbers on the axis, carried responses
in the legend, and a long run drawn for its last steps unless a window is asked for."""

from __future__ import annotations

import json

import matplotlib

from openrlhf_oppo.bench import plot

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)


def make_run(steps: int) -> list[dict]:
    """`steps` steps of 10 s: the driver generates for 6 s, then trains; the engine decodes one
    response a step, the one of step 2 on across its batch (at 16 s) into step 3."""
    rows = []
    for i in range(steps):
        t = 10.0 * i
        rows.append({"kind": "span", "role": "driver", "host": "h", "pid": 1, "stage": "generate", "t0": t,
                     "t1": t + 6.0})
        rows.append({"kind": "span", "role": "driver", "host": "h", "pid": 1, "stage": "train", "t0": t + 7.0,
                     "t1": t + 9.0})
        end = t + 8.0 if i == 1 else t + 5.0
        rows.append({"kind": "sample", "role": "rollout", "host": "h", "pid": 2, "key": i, "t0": t + 1.0, "t1": end,
                     "tokens": 9, "finish": "stop"})
    return rows


def _write_run(run_dir, rows) -> None:
    (run_dir / "timeline").mkdir(parents=True)
    with open(run_dir / "timeline" / "h-1.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)


def test_the_top_axis_names_each_step_from_1_and_the_legend_names_carried_responses():
    fig, ax = plt.subplots()
    plot.draw(ax, make_run(4), "run", from_step=1, steps=2)
    [top] = ax.child_axes
    # steps 2 and 3 drawn, and the start of step 4 that ends the window
    assert [t.get_text() for t in top.get_xticklabels()] == ["step 2", "step 3", "step 4"]
    assert list(top.get_xticks()) == [0.0, 10.0, 20.0]  # seconds from the window's start, step 2's
    labels = ax.get_legend_handles_labels()[1]
    assert labels.count("carried response") == 1 and labels.count("decode (response)") >= 1
    plt.close(fig)


def test_a_long_run_is_drawn_for_its_last_steps_unless_a_window_is_asked_for(tmp_path, capsys):
    run_dir = tmp_path / "long"
    _write_run(run_dir, make_run(plot.DEFAULT_WINDOW_MAX_STEPS + 2))
    rows = plot._read(run_dir)
    assert plot.default_window(run_dir, rows) == (6, plot.DEFAULT_WINDOW_STEPS)
    said = capsys.readouterr().out
    assert "steps 7-10" in said and "--from-step" in said and f"plot trace {run_dir}" in said
    assert plot.default_window(run_dir, rows[: 3 * plot.DEFAULT_WINDOW_MAX_STEPS]) == (0, None)  # 8 steps: all
    assert capsys.readouterr().out == ""
    assert plot.main(["timeline", str(run_dir), "--from-step", "0", "--out", str(tmp_path / "all.png")]) == 0
    assert "too many" not in capsys.readouterr().out  # a window asked for is drawn as asked
    assert (tmp_path / "all.png").read_bytes()[:4] == b"\x89PNG"
