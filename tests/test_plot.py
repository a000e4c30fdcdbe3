"""experiments/plot.py: every panel's curves come from metrics.jsonl, the cost of dynamic
sampling on two y axes (the fraction of tokens thrown away, the tokens per kept group); `make run`
ends by drawing its run's curves. And the progress bar's account of dynamic sampling's cap."""
import json
import os
import re
import subprocess
import sys

import pytest

from experiments import plot
from infra.metrics import RunLog

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rows():
    for step in (1, 2, 3):
        yield {"step": step, "rollout/acc": 0.1 * step, "train/gen_tokens_discarded": 0.5 / step,
               "train/gen_tokens_per_group": 100.0 * step, "train/groups_kept": 8}
    yield {"step": 3, "val/acc": 0.4}


def test_the_cost_panel_plots_both_figures_of_each_step(tmp_path):
    plt = pytest.importorskip("matplotlib.pyplot")
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    out = plot.plot([str(path)], str(tmp_path / "m.png"))
    assert (tmp_path / "m.png").stat().st_size > 10_000 and out.endswith("m.png")
    fig = plt.gcf()
    cost = [ax for ax in fig.axes if ax.get_title() == "cost of dynamic sampling"]
    assert len(cost) == 1
    twins = [ax for ax in fig.axes if ax is not cost[0] and ax.bbox.bounds == cost[0].bbox.bounds]
    assert len(twins) == 1  # the second y axis
    (left,), (right,) = cost[0].lines, twins[0].lines
    assert list(left.get_xdata()) == [1, 2, 3]
    assert list(left.get_ydata()) == pytest.approx([0.5, 0.25, 0.5 / 3])
    assert list(right.get_ydata()) == [100.0, 200.0, 300.0]
    labels = [t.get_text() for t in cost[0].get_legend().get_texts()]
    assert labels == ["train/gen_tokens_discarded", "train/gen_tokens_per_group"]
    plt.close(fig)


def test_a_line_that_is_not_json_names_the_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n\n{"step": 2}\n{"step": 3,\n{"step": 4}\n')
    with pytest.raises(SystemExit, match=r"metrics.jsonl: line 4 is not JSON"):
        plot.read_metrics(str(path))


def test_make_run_draws_the_curves_after_training_and_says_where(tmp_path):
    pytest.importorskip("matplotlib")
    # the Makefile's run recipe as written (`make -n run` would stop in the student handout, whose
    # run first names the exercises not written yet); its last line prints the chat command
    # (tests/test_chat.py)
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    recipe = re.search(r"^run:.*\n((?:\t.*\n)+)", makefile, re.M).group(1).splitlines()
    assert recipe[-3].endswith("dapo.py --out-dir runs/demo --overwrite")
    assert recipe[-2].endswith(
        "-m experiments.plot runs/demo/metrics.jsonl -o runs/demo/curves.png")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    out = subprocess.run([sys.executable, "-m", "experiments.plot", str(tmp_path / "metrics.jsonl"),
                          "-o", str(tmp_path / "curves.png")], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"curves: {tmp_path / 'curves.png'}\n"
    assert (tmp_path / "curves.png").stat().st_size > 10_000


def _step_row(capped: bool) -> dict:
    return {"rollout/acc": 0.9, "rollout/reward/mean": 0.8, "rollout/response_length/mean": 15.0,
            "train/num_gen_batches": 4 if capped else 2, "train/gen_cap_hit": int(capped),
            "train/groups_kept": 8 if capped else 32, "train/groups_surplus": 3 if capped else 0}


def test_the_gen_cap_is_said_once_then_counted_in_the_bar(tmp_path, capsys):
    # before: "dynamic sampling stopped at --max-gen-batches 4 ..." on every such step (22 of the
    # demo's 40)
    log = RunLog(str(tmp_path / "metrics.jsonl"), 0, 4)
    for step, capped in enumerate([False, True, True, False], 1):
        log.step(step, _step_row(capped), 1e-3, 1.0, 1.0)
    out = capsys.readouterr()
    said = [line for line in (out.out + out.err).splitlines() if "dynamic sampling" in line]
    assert said == ["step 2: dynamic sampling stopped at --max-gen-batches (4 generation "
                    "batches) with 11 groups with signal, fewer than --train-prompts; trained on "
                    "the 8 of whole mini-batches. Said once: 'capped' in the bar counts such "
                    "steps (train/gen_cap_hit in metrics.jsonl)"]
    assert log.bar.postfix.endswith("capped=2")
    log.bar.close()


def test_the_eval_change_names_the_steps_of_the_first_and_last_evaluations(tmp_path, capsys):
    # before: "at step {start}": a run resumed at step 5 with --eval-every 10 first evaluates at
    # step 10, and was said to have done so at step 5
    log = RunLog(str(tmp_path / "metrics.jsonl"), 5, 20)
    for step, acc in [(10, 0.25), (20, 0.5), (20, 0.75)]:
        log.evaluated(step, {"val/acc": acc, "val/pass@4": acc})
    log.say_eval_change(4)
    out = capsys.readouterr()
    assert "val/acc (avg@4): 0.250 at step 10 -> 0.750 at step 20; pass@4: 0.250 -> 0.750" in \
        out.out + out.err
    log.bar.close()
