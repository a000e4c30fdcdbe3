"""ablate.py: the rows are the paper's Table 1, and the table is computed right from (hand-made) metrics logs."""
import json
import os
from dataclasses import asdict

import pytest

import ablate
from ablate import ROWS, TECHNIQUES, AblateConfig, add_derived, build_table, row_switches, summarize
from dapo import Config


def fake_metrics(acc, val=(0.3, 0.5), kept=2, filtered=1, group_size=4):
    """A run's metrics.jsonl rows as dapo.py logs them: an evaluation at step 0 and at the end, a rollout per step."""
    rows = [{"step": 0, "val/acc": val[0], "val/pass@4": 0.5}]
    for i, a in enumerate(acc):
        rows.append({"step": i + 1, "rollout/acc": a, "actor/entropy": 1.0 - 0.1 * i, "rollout/response_length/mean": 20.0 + i,
                     "dapo/clipfrac_high": 0.01 * i, "dapo/clipfrac_low": 0.02,
                     "rollout/clip_ratio": 0.1, "train/groups_kept": kept, "train/groups_filtered": filtered,
                     "rollout/frac_all_correct": 0.25, "rollout/frac_all_wrong": 0.125})
    rows.append({"step": len(acc), "val/acc": val[1], "val/pass@4": 0.9})
    return add_derived(rows, group_size)


def test_rows_add_the_techniques_in_the_papers_order_and_end_at_dapo_defaults():
    assert [label for label, _, _ in ROWS] == ["naive GRPO", "+ overlong filtering", "+ clip-higher",
                                               "+ soft overlong punishment", "+ token-level loss",
                                               "+ dynamic sampling (DAPO)"]
    assert row_switches(1) == dict.fromkeys(TECHNIQUES, False)
    assert row_switches(len(ROWS)) == {t: getattr(Config(), t) for t in TECHNIQUES}  # the last row is full DAPO
    turned_on = [{t for t in TECHNIQUES if row_switches(r)[t] and not row_switches(r - 1)[t]}
                 for r in range(2, len(ROWS) + 1)]
    assert turned_on == [{"overlong_filtering"}, {"clip_higher"}, {"overlong_shaping"}, {"token_level_loss"},
                         {"dynamic_sampling"}]
    assert not row_switches(4)["overlong_filtering"]  # the soft punishment replaces filtering


def test_every_run_of_a_seed_differs_only_in_the_switches():
    acfg = AblateConfig(steps=7, seeds=[3], set=["lr=1e-3"])
    configs = [asdict(ablate.run_config(acfg, row, 3)) for row in range(1, len(ROWS) + 1)]
    assert all(c["steps"] == 7 and c["seed"] == 3 and c["lr"] == 1e-3 for c in configs)
    for c in configs[1:]:
        assert {k for k in c if c[k] != configs[0][k]} <= set(TECHNIQUES) | {"out_dir"}
    assert len({c["out_dir"] for c in configs}) == len(ROWS)  # no run overwrites another


def test_overrides_are_typed_and_the_switches_are_refused():
    assert ablate.parse_overrides(["lr=1e-3", "group_size=4", "activation_checkpointing=true"]) == \
        {"lr": 1e-3, "group_size": 4, "activation_checkpointing": True}
    for bad in (["clip_higher=false"], ["seed=1"], ["no_such_field=1"], ["lr"]):
        with pytest.raises(SystemExit):
            ablate.parse_overrides(bad)


def test_steps_to_target_use_the_moving_average_of_rollout_accuracy():
    metrics = fake_metrics([0.2, 0.7, 0.3, 0.7, 0.7])
    one = summarize(metrics, target_acc=0.6, window=1)
    assert one["steps_to_target"] == 2 and one["responses_to_target"] == 2 * 12  # (2 kept + 1 filtered) x 4
    two = summarize(metrics, target_acc=0.6, window=2)  # means 0.2, 0.45, 0.5, 0.5, 0.7
    assert two["steps_to_target"] == 5 and two["responses_to_target"] == 5 * 12
    assert summarize(metrics, target_acc=0.9, window=1)["steps_to_target"] is None


def test_summary_reads_the_last_evaluation_and_the_quarters():
    s = summarize(fake_metrics([0.5] * 8, val=(0.25, 0.75)), target_acc=0.6, window=1)
    assert (s["val_first"], s["val_last"]) == (0.25, 0.75)
    assert s["entropy"] == pytest.approx((0.95, 0.35))  # steps 1-2: 1.0, 0.9; steps 7-8: 0.4, 0.3
    assert s["length"] == pytest.approx((20.5, 26.5))
    assert s["no_signal"] == pytest.approx(0.375) and s["responses"] == 8 * 12


def _summaries(final_vals, target_acc=0.6):
    """{row: {seed: summary}} with the given final val/acc per row and seed; rollout accuracy 0.3, 0.4, 0.5, 0.6."""
    return {row: {seed: summarize(fake_metrics([0.3, 0.4, 0.5, 0.6], val=(0.3, v)), target_acc, 1)
                  for seed, v in enumerate(vals)} for row, vals in final_vals.items()}


def test_table_pairs_seeds_and_says_when_a_difference_is_noise():
    table = build_table(_summaries({1: [0.30, 0.50, 0.40], 2: [0.41, 0.60, 0.49], 3: [0.51, 0.50, 0.39],
                                    4: [0.53, 0.53, 0.40]}), 0.6)
    lines = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in table.splitlines() if "|" in line}
    assert lines["1. naive GRPO"][2] == "0.400 ± 0.100"  # mean ± sd over the three seeds
    assert lines["2. + overlong filtering"][3] == "+0.100 ± 0.006"  # every seed gained ~0.1: paired, tiny error
    assert lines["3. + clip-higher"][3].endswith("~ noise")  # +0.1, -0.1, -0.1: no telling
    # +0.02, +0.03, +0.01: 3.5 standard errors, but with 3 seeds a t-test at 95% needs 4.3
    assert lines["4. + soft overlong punishment"][3] == "+0.020 ± 0.006 ~ noise"
    assert lines["1. naive GRPO"][6] == "1.50% / 2.00%"  # clip fractions 0, 0.01, 0.02, 0.03 at the top
    assert lines["1. naive GRPO"][9] == "4 (48)"  # rollout accuracy reaches 0.6 at step 4, after 4 x 12 responses


def test_table_with_one_seed_has_no_spread():
    table = build_table(_summaries({5: [0.4], 6: [0.5]}, target_acc=0.5), 0.5)
    row6 = next(line for line in table.splitlines() if line.startswith("| 6."))
    assert "±" not in row6 and "+0.100 (1 seed)" in row6 and "| 3 (36) |" in row6


def test_report_writes_the_table_and_the_figure_and_refuses_mixed_settings(tmp_path):
    pytest.importorskip("matplotlib")
    acfg = AblateConfig(out_dir=str(tmp_path), rows=[1, 6], seeds=[0, 1])
    for row in acfg.rows:
        for seed in acfg.seeds:
            path = ablate.run_dir(acfg.out_dir, row, seed)
            os.makedirs(path)
            with open(os.path.join(path, "metrics.jsonl"), "w") as f:
                f.writelines(json.dumps({k: v for k, v in m.items() if k not in ("responses_generated",
                                                                                  "rollout/frac_no_signal")}) + "\n"
                             for m in fake_metrics([0.4, 0.5, 0.6, 0.7], val=(0.3, 0.4 + 0.1 * row / 6)))
            with open(os.path.join(path, "run.json"), "w") as f:
                json.dump({"row": row, "seed": seed, "wall_s": 60.0, "threads": 1,
                           "config": asdict(ablate.run_config(acfg, row, seed))}, f)
    ablate.report(acfg)
    assert (tmp_path / "ablation.png").stat().st_size > 10_000
    table = (tmp_path / "table.md").read_text()
    assert "| 1. naive GRPO |" in table and "| 6. + dynamic sampling (DAPO) |" in table
    assert "val/acc at step 0, as each seed samples it: seed 0 0.300, seed 1 0.300" in table

    info_path = os.path.join(ablate.run_dir(acfg.out_dir, 6, 1), "run.json")
    with open(info_path) as f:
        info = json.load(f)
    info["config"]["lr"] *= 2
    with open(info_path, "w") as f:
        json.dump(info, f)
    with pytest.raises(SystemExit, match="other settings"):
        ablate.report(acfg)
