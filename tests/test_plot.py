"""experiments/plot.py: every panel's curves come from metrics.jsonl, the cost of dynamic
sampling on two y axes (the fraction of tokens thrown away, the tokens per kept group)."""
import json

import pytest

import plot


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
