"""ablate.py: each row is DAPO with one technique off, and the table is computed right from
(hand-made) logs."""
import json
import os
from dataclasses import asdict

import pytest

from experiments import ablate
from experiments.ablate import REGIME, ROWS, TECHNIQUES, AblateConfig, paired, summarize
from dapo import Config


def fake_metrics(acc, no_signal=0.25, length=30.0, clip_ratio=0.1, kept=4, filtered=2):
    """A run's metrics.jsonl rows as dapo.py logs them, one per rollout step."""
    return [{"step": i + 1, "rollout/acc": a, "actor/entropy": 1.0 - 0.1 * i,
             "rollout/response_length/mean": length + i, "rollout/truncated": clip_ratio,
             "rollout/frac_all_correct": no_signal, "rollout/frac_all_wrong": 0.0,
             "dapo/clipfrac_high": 0.01, "train/groups_kept": kept,
             "train/groups_filtered": filtered}
            for i, a in enumerate(acc)]


PROBED = {"val_acc": 0.5, "distinct": 1.5, "repeats": 0.2, "worked": 0.9, "truncated": 0.0,
          "length": 30.0}


def test_the_first_row_is_dapo_and_every_other_row_switches_one_technique_off():
    assert ROWS[0].switches == {}
    for row in ROWS[1:]:
        assert len(row.switches) == 1 and set(row.switches) <= set(TECHNIQUES)
        name, value = next(iter(row.switches.items()))
        assert value != getattr(Config(), name)  # DAPO's default, another value in the row
        assert value is False or name == "loss_agg_mode"  # a switch off, or naive GRPO's mean
    assert len({name for row in ROWS for name in row.switches}) == len(ROWS) - 1


def test_runs_of_a_seed_differ_only_in_the_rows_switch():
    acfg = AblateConfig(steps=7, seeds=[3], set=["lr=1e-3"])
    configs = [asdict(ablate.run_config(acfg, row, 3)) for row in range(1, len(ROWS) + 1)]
    assert all(c["steps"] == 7 and c["seed"] == 3 and c["lr"] == 1e-3 for c in configs)
    assert all(configs[0][k] == v for k, v in REGIME.items() if k != "lr")
    for row, c in zip(ROWS[1:], configs[1:]):
        assert {k for k in c if c[k] != configs[0][k]} == set(row.switches) | {"out_dir"}


def test_overrides_are_typed_and_the_switches_are_refused():
    assert ablate.parse_overrides(["lr=1e-3", "group_size=4", "activation_checkpointing=true"]) == \
        {"lr": 1e-3, "group_size": 4, "activation_checkpointing": True}
    assert ablate.parse_overrides(["report_to=jsonl,tensorboard"]) == \
        {"report_to": ("jsonl", "tensorboard")}  # a tuple field: values split at commas
    for bad in (["clip_higher=false"], ["seed=1"], ["model=x"], ["no_such_field=1"], ["lr"]):
        with pytest.raises(SystemExit):
            ablate.parse_overrides(bad)


def test_steps_to_target_use_the_moving_average_and_count_a_miss_as_one_past_the_end():
    config = {"group_size": 4, "dynamic_sampling": True}
    metrics = fake_metrics([0.2, 0.7, 0.3, 0.7, 0.7])
    one = summarize(metrics, PROBED, config, target_acc=0.6, window=1)
    # (4 kept + 2 filtered) x 4
    assert one["steps_to_target"] == 2 and one["responses_to_target"] == 2 * 6 * 4
    # means 0.2, 0.45, 0.5, 0.5, 0.7
    two = summarize(metrics, PROBED, config, target_acc=0.6, window=2)
    assert two["steps_to_target"] == 5 and two["reached"]
    miss = summarize(metrics, PROBED, config, target_acc=0.9, window=1)
    assert miss["steps_to_target"] == 6 and not miss["reached"]


def test_groups_with_signal_are_the_kept_groups_only_with_dynamic_sampling():
    metrics = fake_metrics([0.5] * 4, no_signal=0.25, kept=8)
    with_ds = summarize(metrics, PROBED, {"group_size": 4, "dynamic_sampling": True}, 0.9, 1)
    without = summarize(metrics, PROBED, {"group_size": 4, "dynamic_sampling": False}, 0.9, 1)
    # a quarter of 8 all right
    assert with_ds["signal_groups"] == 8 and without["signal_groups"] == 6


def test_quantities_logged_per_step_are_averaged_over_the_run():
    s = summarize(fake_metrics([0.5] * 4, length=20.0), PROBED,
                  {"group_size": 4, "dynamic_sampling": True}, 0.9, 1)
    # 20-23; 1.0-0.7
    assert s["length"] == pytest.approx(21.5) and s["entropy"] == pytest.approx(0.85)


def test_paired_test_signs_the_difference_the_papers_way_and_says_when_it_is_noise():
    dapo_runs, row_runs = {0: 1.0, 1: 2.0, 2: 3.0}, {0: 0.9, 1: 1.9, 2: 2.9}
    mean, se, t, verdict = paired(dapo_runs, row_runs, "higher")
    assert mean == pytest.approx(0.1) and se == pytest.approx(0.0, abs=1e-12) and verdict == "yes"
    assert paired(dapo_runs, row_runs, "lower")[3] == "opposite, beyond noise"
    # +0.02, +0.03, +0.01: 3.5 standard errors, but with 3 seeds a t-test at 95% needs 4.3
    close = paired({0: 0.52, 1: 0.53, 2: 0.51}, {0: 0.5, 1: 0.5, 2: 0.5}, "higher")
    assert close[3] == "within noise"
    assert paired({0: 1.0}, {0: 0.5}, "higher")[3] == "1 seed(s): no test"


def test_report_writes_the_table_and_the_figure_and_refuses_mixed_settings(tmp_path):
    pytest.importorskip("matplotlib")
    acfg = AblateConfig(out_dir=str(tmp_path), steps=4, rows=[1, 2], seeds=[0, 1])
    for row in acfg.rows:
        for seed in acfg.seeds:
            path = ablate.run_dir(acfg.out_dir, row, seed)
            os.makedirs(path)
            with open(os.path.join(path, "metrics.jsonl"), "w") as f:
                f.writelines(json.dumps(m) + "\n" for m in fake_metrics([0.4, 0.5, 0.6, 0.7]))
            with open(os.path.join(path, "probe.json"), "w") as f:
                json.dump(dict(PROBED, distinct=2.0 - row / 2 + seed / 10), f)
            with open(os.path.join(path, "run.json"), "w") as f:
                json.dump({"row": row, "seed": seed, "wall_s": 60.0, "threads": 1,
                           "config": asdict(ablate.run_config(acfg, row, seed))}, f)
    ablate.report(acfg)
    assert (tmp_path / "ablation.png").stat().st_size > 10_000
    table = (tmp_path / "table.md").read_text()
    line = next(line for line in table.splitlines() if "distinct right answers" in line)
    assert "| 1.55 ± 0.07 | 1.05 ± 0.07 | +0.50 ± 0.00 |" in line and line.endswith("| yes |")

    info_path = os.path.join(ablate.run_dir(acfg.out_dir, 2, 1), "run.json")
    with open(info_path) as f:
        info = json.load(f)
    info["config"]["lr"] *= 2
    with open(info_path, "w") as f:
        json.dump(info, f)
    with pytest.raises(SystemExit, match="other settings"):
        ablate.report(acfg)
