"""
The paper's ablation (Table 1) at toy scale, in one command. Naive GRPO first, then DAPO's techniques switched on one
at a time in the paper's order, ending at full DAPO. Every run starts from the same base model (the demo's, trained
once by warmup.py and cached), as every row of the paper starts from Qwen2.5-32B base; a seed varies the RL only (data
order, sampling). Each row runs the same seeds for the same number of rollout steps and is otherwise the demo's
configuration (dapo.Config's defaults).

    python ablate.py                              # `make ablate`: every row x seed, then the table and the figure
    python ablate.py --report-only                # rebuild table.md and ablation.png from the finished runs
    python ablate.py --rows 1 6 --seeds 0         # naive GRPO against full DAPO, one seed
    python ablate.py --set mini_batch_prompts=4   # change a dapo.Config field for every row

Writes out_dir/base-model/ (the base model with the toy tokenizer, the --model of every run), out_dir/row{N}/seed{S}/
(each run's metrics.jsonl, checkpoint and run.json), out_dir/table.md and out_dir/ablation.png.

Rows are compared at equal rollout steps, as in the paper. The table also counts the responses each row generated:
with dynamic sampling a step keeps sampling generation batches until it has enough groups whose answers disagree, so
it trains on as many groups as the other rows but generates more of them (paper Sec. 4.2: more samples, fewer steps).
"""
import argparse
import itertools
import json
import os
import shutil
import statistics
import time
from dataclasses import MISSING, asdict, dataclass, field, fields

import torch

import dapo
from plot import read_metrics, series

TECHNIQUES = ("clip_higher", "dynamic_sampling", "token_level_loss", "overlong_shaping", "overlong_filtering")

# The rows of the paper's Table 1: (label, the paper's AIME24 avg@32, what the row changes from the row above)
ROWS = [
    ("naive GRPO", 30, dict(clip_higher=False, dynamic_sampling=False, token_level_loss=False,
                           overlong_shaping=False, overlong_filtering=False)),
    ("+ overlong filtering", 36, dict(overlong_filtering=True)),
    ("+ clip-higher", 38, dict(clip_higher=True)),
    # Sec. 3.4 tries filtering first ("to investigate the impact of this reward noise") and then proposes the soft
    # punishment as the fix; Algorithm 1, the run's settings (Sec. 4.1) and verl's release shape the reward and mask
    # nothing. So the punishment takes filtering's place here, and the last row is dapo.py's defaults.
    ("+ soft overlong punishment", 41, dict(overlong_shaping=True, overlong_filtering=False)),
    ("+ token-level loss", 42, dict(token_level_loss=True)),
    ("+ dynamic sampling (DAPO)", 50, dict(dynamic_sampling=True)),
]


@dataclass
class AblateConfig:
    out_dir: str = field(default="runs/ablate", metadata={"help": "the runs, table.md and ablation.png go here"})
    # 6 rows x 3 seeds x 12 steps: 11 min on a busy 2-core CPU (one step ~3 s, with dynamic sampling up to ~5 s);
    # the demo's accuracy is ~0.8 by step 10, so most of what the techniques change happens in these steps
    steps: int = field(default=12, metadata={"help": "rollout steps of every run"})
    seeds: list = field(default_factory=lambda: [0, 1, 2],
                        metadata={"help": "one run per seed and row; a seed fixes the data order and the sampling"})
    rows: list = field(default_factory=lambda: list(range(1, len(ROWS) + 1)),
                       metadata={"help": "rows of the table to run or report (1 = naive GRPO, 6 = DAPO)"})
    base_seed: int = field(default=0, metadata={"help": "the seed of the demo base model every run starts from"})
    eval_every: int = field(default=4, metadata={"help": "evaluate every N steps (and at step 0 and the end)"})
    # where many groups are all right, so dynamic sampling has something to drop (the demo levels off near 0.9)
    target_acc: float = field(default=0.8, metadata={"help": "report the steps to this rollout accuracy"})
    window: int = field(default=3, metadata={"help": "moving average over this many steps (curves and target)"})
    set: list = field(default_factory=list, metadata={"help": "dapo.Config fields for every row, as name=value"})
    # the demo's model is too small for a second thread to help, and on a busy machine two threads are much slower
    threads: int = field(default=1, metadata={"help": "torch threads (0: torch's default)"})
    report_only: bool = field(default=False, metadata={"help": "rebuild the table and figure from finished runs"})


def parse_args(argv=None) -> AblateConfig:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(AblateConfig):
        default = f.default_factory() if f.default is MISSING else f.default
        if isinstance(default, bool):
            kind = dict(action=argparse.BooleanOptionalAction)
        elif isinstance(default, list):  # the items' type from the default (an empty list holds strings)
            kind = dict(nargs="*", type=type(default[0]) if default else str)
        else:
            kind = dict(type=type(default))
        p.add_argument("--" + f.name.replace("_", "-"), **kind, default=default,
                       help=f.metadata["help"] + " (default: %(default)r)")
    return AblateConfig(**vars(p.parse_args(argv)))


def row_switches(row):
    """The technique switches of table row `row` (1-based): every change from row 1 down to it, in order."""
    switches = {}
    for _, _, change in ROWS[:row]:
        switches.update(change)
    return switches


def parse_overrides(pairs):
    """["name=value", ...] -> {name: value}, typed as dapo.Config's fields."""
    types = {f.name: type(f.default) for f in fields(dapo.Config)}
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        name = name.strip().lstrip("-").replace("-", "_")
        if not sep or name not in types:
            raise SystemExit(f"--set {pair!r}: expected name=value with a field of dapo.Config")
        if name in TECHNIQUES + ("seed", "steps", "out_dir", "eval_every", "resume", "eval_only"):
            raise SystemExit(f"--set {name}: the ablation sets this itself (rows, --seeds, --steps, --out-dir, "
                             "--eval-every)")
        if types[name] is bool:
            if value.lower() not in ("true", "false", "1", "0"):
                raise SystemExit(f"--set {pair!r}: a switch takes true or false")
            out[name] = value.lower() in ("true", "1")
        else:
            out[name] = types[name](value)
    return out


def run_dir(out_dir, row, seed):
    return os.path.join(out_dir, f"row{row}", f"seed{seed}")


def run_config(acfg, row, seed) -> dapo.Config:
    overrides = parse_overrides(acfg.set)
    return dapo.Config(**{"model": os.path.join(acfg.out_dir, "base-model"), **overrides, **row_switches(row),
                          "seed": seed, "steps": acfg.steps, "eval_every": acfg.eval_every,
                          "out_dir": run_dir(acfg.out_dir, row, seed)})


def prepare_base_model(acfg):
    """The demo's base model (warmup.py: trained once per base seed, then cached in runs/demo-base) and the toy
    tokenizer, written as one Hugging Face model directory: every run loads it as its --model. Without this, a run's
    seed would also pick its base model, and each new seed would cost a warm-up."""
    from toy import make_toy_tokenizer
    from toy import demo_base_model
    path = os.path.join(acfg.out_dir, "base-model")
    model = demo_base_model(make_toy_tokenizer(path), dapo.Config(**parse_overrides(acfg.set)).device,
                            seed=acfg.base_seed)
    model.save_pretrained(path)  # the weights and config.json, beside the tokenizer files
    return path


def run_all(acfg):
    """Train every (row, seed). Seeds outermost: a session cut short still leaves whole seeds to compare rows on."""
    if "model" not in parse_overrides(acfg.set):  # --set model=DIR ablates that model instead of the demo's
        prepare_base_model(acfg)
    for seed in acfg.seeds:
        for row in acfg.rows:
            cfg = run_config(acfg, row, seed)
            shutil.rmtree(cfg.out_dir, ignore_errors=True)  # metrics.jsonl is appended to: start each run afresh
            print(f"=== row {row}: {ROWS[row - 1][0]}, seed {seed} ===", flush=True)
            t0 = time.time()
            dapo.main(cfg)
            with open(os.path.join(cfg.out_dir, "run.json"), "w") as f:  # written last: marks a finished run
                json.dump({"row": row, "seed": seed, "wall_s": time.time() - t0, "threads": torch.get_num_threads(),
                           "config": asdict(cfg)}, f)


# ----------------------------------------------------------------------------------------------------------------------
# Reading the runs back

def add_derived(metrics, group_size):
    """Add to each rollout step of a run's metrics the responses generated so far and the fraction of groups
    without signal (all right or all wrong). Returns the same list."""
    generated = 0
    for m in metrics:
        if "rollout/acc" in m:  # a rollout step (an evaluation logs val/acc instead)
            generated += (m["train/groups_kept"] + m["train/groups_filtered"]
                          + m.get("train/groups_surplus", 0)) * group_size
            m["responses_generated"] = generated
            m["rollout/frac_no_signal"] = m["rollout/frac_all_correct"] + m["rollout/frac_all_wrong"]
    return metrics


def load_runs(acfg):
    """{(row, seed): (run.json, metrics rows)} for the requested rows and seeds that finished."""
    runs = {}
    for row, seed in itertools.product(acfg.rows, acfg.seeds):
        path = run_dir(acfg.out_dir, row, seed)
        if not os.path.isfile(os.path.join(path, "run.json")):
            continue
        with open(os.path.join(path, "run.json")) as f:
            info = json.load(f)
        runs[row, seed] = info, add_derived(read_metrics(os.path.join(path, "metrics.jsonl")),
                                            info["config"]["group_size"])
    shared = lambda config: {k: v for k, v in config.items() if k not in TECHNIQUES + ("seed", "out_dir")}
    first = next(iter(runs.values()), None)
    for (row, seed), (info, _) in runs.items():  # rows are comparable only if nothing but the switches differs
        diff = {k for k, v in shared(info["config"]).items() if shared(first[0]["config"]).get(k) != v}
        if diff:
            raise SystemExit(f"{run_dir(acfg.out_dir, row, seed)} ran with other settings ({', '.join(sorted(diff))})"
                             " than the other runs: run the ablation again, or pick --rows/--seeds")
    return runs


def moving_average(values, window):
    """The trailing mean over the last `window` values (over fewer at the start)."""
    return [statistics.fmean(values[max(0, i + 1 - window):i + 1]) for i in range(len(values))]


def first_and_last_quarter(values):
    """(mean of the first quarter, mean of the last quarter) of a run's per-step values; None if there are none."""
    if not values:
        return None
    q = max(1, len(values) // 4)
    return statistics.fmean(values[:q]), statistics.fmean(values[-q:])


def summarize(metrics, target_acc, window):
    """One run's numbers for the table. "First/last" are the means over the first and the last quarter of the steps.
    Steps to target: the first step at which the moving average of the rollout accuracy (the policy's accuracy on
    fresh training prompts, every response generated counted) reaches target_acc; None if it never does."""
    steps, acc = series(metrics, "rollout/acc")
    _, generated = series(metrics, "responses_generated")
    smooth = moving_average(acc, window)
    hit = next((i for i, a in enumerate(smooth) if a >= target_acc), None)
    _, val = series(metrics, "val/acc")
    return {
        "val_first": val[0] if val else None, "val_last": val[-1] if val else None,
        "entropy": first_and_last_quarter(series(metrics, "actor/entropy")[1]),
        "length": first_and_last_quarter(series(metrics, "rollout/response_length/mean")[1]),
        "clip_high": statistics.fmean(series(metrics, "dapo/clipfrac_high")[1] or [0.0]),
        "clip_low": statistics.fmean(series(metrics, "dapo/clipfrac_low")[1] or [0.0]),
        "truncated": statistics.fmean(series(metrics, "rollout/clip_ratio")[1]),
        "no_signal": statistics.fmean(series(metrics, "rollout/frac_no_signal")[1]),
        "steps_to_target": None if hit is None else steps[hit],
        "responses_to_target": None if hit is None else generated[hit],
        "responses": generated[-1], "steps": steps[-1],
    }


# ----------------------------------------------------------------------------------------------------------------------
# The table

def _k(n):
    return f"{n / 1000:.1f}k" if n >= 1000 else f"{n:.0f}"


def _pair(pair, fmt):
    return "-" if pair is None else f"{pair[0]:{fmt}} → {pair[1]:{fmt}}"


# Student's t, two-sided 95%, by degrees of freedom (seeds - 1): with 3 seeds a difference must be 4.3 standard errors
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23}


def delta_cell(now, before):
    """Row minus the row above on final val/acc, paired by seed (a seed is the same data order and sampling in every
    row): mean ± standard error over seeds, and "~ noise" when a paired t-test at 95% cannot tell it from 0."""
    seeds = sorted(set(now) & set(before))
    diffs = [now[s]["val_last"] - before[s]["val_last"] for s in seeds
             if now[s]["val_last"] is not None and before[s]["val_last"] is not None]
    if not diffs:
        return "-"
    mean = statistics.fmean(diffs)
    if len(diffs) == 1:
        return f"{mean:+.3f} (1 seed)"
    se = statistics.stdev(diffs) / len(diffs) ** 0.5
    return f"{mean:+.3f} ± {se:.3f}" + (" ~ noise" if abs(mean) <= T95.get(len(diffs) - 1, 2.0) * se else "")


def build_table(summaries, target_acc, caption=""):
    """summaries {row: {seed: summarize(...)}} -> the markdown table (with its caption and notes)."""
    head = ["row", "paper AIME24", "val/acc (mean ± sd)", "Δ vs row above", "entropy first → last",
            "length first → last", "clipped high / low", "truncated", "no-signal groups",
            f"steps (responses) to acc ≥ {target_acc:g}",
            "responses generated"]
    lines = ([caption, ""] if caption else []) + ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    baseline = None
    rows = sorted(summaries)
    for i, row in enumerate(rows):
        runs = summaries[row]
        seeds = sorted(runs)
        vals = [runs[s]["val_last"] for s in seeds if runs[s]["val_last"] is not None]
        val = "-" if not vals else f"{statistics.fmean(vals):.3f}" + (
            f" ± {statistics.stdev(vals):.3f}" if len(vals) > 1 else "")
        above = summaries.get(row - 1)
        delta = delta_cell(runs, above) if above else "-"
        mean_pair = lambda key: None if any(runs[s][key] is None for s in seeds) else tuple(
            statistics.fmean(runs[s][key][j] for s in seeds) for j in (0, 1))
        hits = [s for s in seeds if runs[s]["steps_to_target"] is not None]
        to_target = "-" if not hits else (f"{statistics.fmean(runs[s]['steps_to_target'] for s in hits):.0f} "
                                          f"({_k(statistics.fmean(runs[s]['responses_to_target'] for s in hits))})")
        if len(hits) < len(seeds):
            to_target += f", {len(hits)}/{len(seeds)} seeds"
        responses = statistics.fmean(runs[s]["responses"] for s in seeds)
        baseline = baseline or responses
        lines.append("| " + " | ".join([
            f"{row}. {ROWS[row - 1][0]}", str(ROWS[row - 1][1]), val, delta, _pair(mean_pair("entropy"), ".3f"),
            _pair(mean_pair("length"), ".1f"),
            " / ".join(f"{statistics.fmean(runs[s][k] for s in seeds):.2%}" for k in ("clip_high", "clip_low")),
            f"{statistics.fmean(runs[s]['truncated'] for s in seeds):.1%}",
            f"{statistics.fmean(runs[s]['no_signal'] for s in seeds):.1%}", to_target,
            f"{_k(responses)} ({responses / baseline:.2f}x)"]) + " |")
    lines += ["", "val/acc: held-out avg@k after the last step; ± is the standard deviation over seeds. Δ: the change "
              "from the row above, paired by seed, ± its standard error; \"~ noise\": a paired t-test (95%) cannot "
              "tell it from 0. Entropy (nats/token) and response length (tokens): means over the first and the last "
              "quarter of the steps. Clipped: the fraction of trained tokens whose ratio was clipped at the top "
              "(A > 0, r > 1 + eps_high) and at the bottom (A < 0, r < 1 - eps_low). Truncated: responses cut at the "
              "length limit. No-signal groups: groups whose answers are all right or all wrong (zero advantage), "
              "before dynamic sampling drops them. Steps (responses) to acc: the first step at which the moving "
              "average of the rollout accuracy reaches it, mean over the seeds that did, and the responses generated "
              "by then. Responses generated: over the whole run, and relative to the first row."]
    return "\n".join(lines)


def caption(runs):
    info, metrics = next(iter(runs.values()))
    c = info["config"]
    evals = [m for m in metrics if "val/acc" in m]
    k = next((key.split("@")[1] for key in evals[0] if key.startswith("val/pass@")), "?") if evals else "?"
    base = {seed: next((m["val/acc"] for m in ms if "val/acc" in m), None) for (_, seed), (_, ms) in runs.items()}
    walls = [i["wall_s"] for i, _ in runs.values()]  # each run's own time: the base model was ready before
    seeds = sorted({seed for _, seed in runs})
    return (f"## The paper's Table 1 at toy scale\n\n{c['steps']} rollout steps of {c['train_prompts']} prompts x "
            f"{c['group_size']} responses (dynamic sampling: generation batches of {c['gen_prompts']} prompts, at most "
            f"{c['max_gen_batches']} a step), {c['mini_batch_prompts']} prompts per optimizer step, lr {c['lr']:g}, "
            f"responses cut at {c['max_response_len']} tokens (overlong buffer {c['overlong_buffer']}); "
            f"{len(seeds)} seed(s) ({', '.join(map(str, seeds))}) per row; val/acc is avg@{k} on {c['eval_prompts']} "
            f"held-out problems, every {c['eval_every']} steps. Every run starts from the same base model; its "
            f"val/acc at step 0, as each seed samples it: "
            + ", ".join(f"seed {s} {v:.3f}" for s, v in sorted(base.items()) if v is not None)
            + f". One run took {statistics.median(walls) / 60:.1f} min (median of {len(walls)}, "
            f"{info.get('threads', '?')} torch thread(s)).")


# ----------------------------------------------------------------------------------------------------------------------
# The figure: every row's curves, averaged over seeds

PANELS = [  # (title, metric, x axis, smoothed)
    ("held-out accuracy (val/acc)", "val/acc", "step", False),
    ("rollout accuracy vs responses generated", "rollout/acc", "responses_generated", True),
    ("entropy (nats/token)", "actor/entropy", "step", True),
    ("response length (tokens)", "rollout/response_length/mean", "step", True),
    ("truncated responses (fraction)", "rollout/clip_ratio", "step", True),
    ("groups all right or all wrong (fraction)", "rollout/frac_no_signal", "step", True),
]


def mean_curve(runs, key, x_key, window):
    """Mean over seeds at every step all the seeds logged: x (the mean of x_key), y (smoothed if window > 1), and
    the min and max over seeds."""
    per_seed = []
    for metrics in runs:
        points = {m["step"]: (m[x_key] if x_key != "step" else m["step"], m[key]) for m in metrics
                  if m.get(key) is not None}
        per_seed.append(points)
    steps = sorted(set.intersection(*(set(p) for p in per_seed))) if per_seed else []
    x = [statistics.fmean(p[s][0] for p in per_seed) for s in steps]
    ys = [moving_average([p[s][1] for s in steps], window) for p in per_seed]
    y = [statistics.fmean(col) for col in zip(*ys)]
    return x, y, [min(col) for col in zip(*ys)], [max(col) for col in zip(*ys)]


def plot_ablation(runs, out, window):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("ablate.py draws its figure with matplotlib: pip install -r requirements-extra.txt") from None
    rows = sorted({row for row, _ in runs})
    n_seeds = len({seed for _, seed in runs})
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    for ax, (title, key, x_key, smoothed) in zip(axes.flat, PANELS):
        for row in rows:
            x, y, lo, hi = mean_curve([m for (r, _), (_, m) in sorted(runs.items()) if r == row], key, x_key,
                                      window if smoothed else 1)
            if not x:
                continue
            color = "black" if row == len(ROWS) else f"C{row - 1}"
            ax.plot(x, y, "-o" if key == "val/acc" else "-", color=color, markersize=3,
                    linewidth=2 if row == len(ROWS) else 1.2, label=f"{row}. {ROWS[row - 1][0]}")
            if n_seeds > 1:
                ax.fill_between(x, lo, hi, color=color, alpha=0.08, linewidth=0)
        ax.set_title(title + (f", {window}-step mean" if smoothed and window > 1 else ""), fontsize=10)
        ax.set_xlabel("responses generated" if x_key == "responses_generated" else "rollout step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"DAPO ablation at toy scale (paper Table 1): mean of {n_seeds} seed(s), band = min..max over seeds")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def report(acfg):
    runs = load_runs(acfg)
    if not runs:
        raise SystemExit(f"no finished run under {acfg.out_dir} for rows {acfg.rows} and seeds {acfg.seeds}")
    summaries = {}
    for (row, seed), (_, metrics) in sorted(runs.items()):
        summaries.setdefault(row, {})[seed] = summarize(metrics, acfg.target_acc, acfg.window)
    table = build_table(summaries, acfg.target_acc, caption(runs))
    with open(os.path.join(acfg.out_dir, "table.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    print(f"\nwrote {os.path.join(acfg.out_dir, 'table.md')} and "
          f"{plot_ablation(runs, os.path.join(acfg.out_dir, 'ablation.png'), acfg.window)}")


def main(acfg: AblateConfig):
    if not acfg.rows or not set(acfg.rows) <= set(range(1, len(ROWS) + 1)):
        raise SystemExit(f"--rows: numbers from 1 to {len(ROWS)}")
    parse_overrides(acfg.set)  # a typo fails now, not after the first run
    if acfg.threads:
        torch.set_num_threads(acfg.threads)
    if not acfg.report_only:
        t0 = time.time()
        run_all(acfg)
        print(f"{len(acfg.rows) * len(acfg.seeds)} runs in {(time.time() - t0) / 60:.1f} min", flush=True)
    report(acfg)


if __name__ == "__main__":
    main(parse_args())
