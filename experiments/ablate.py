"""
DAPO's four techniques at toy scale, each judged on what it acts on, in one command (`make ablate`).

Each technique of the paper fixes a failure (Sec. 3.1-3.4). Each row here is DAPO (dapo.py's
defaults) with ONE technique switched off, so the row's difference from the DAPO row is that
technique's effect alone, measured on the quantity the technique acts on:

  row                  the failure without the technique (paper)  judged on
  no clip-higher       low-probability tokens cannot rise,        entropy, distinct right answers
                       entropy collapses
  no dynamic sampling  all-right groups carry no gradient:        steps to the target accuracy
                       slower progress
  no token-level loss  a long response's tokens weigh less:       length, repetition, truncation
                       rambling lives on
  no overlong shaping  sound but truncated responses are          truncated responses, accuracy
                       punished: noise

The paper's Table 1 adds the techniques one at a time; removing each from DAPO instead compares
every technique with the same reference, in the setting where it is used, with one row per
technique. Every run starts from the same base model (ablate_toy.py's, trained once and cached) with
the same settings (REGIME); a seed fixes the data order and the sampling, the same in every row, so
rows are compared seed by seed (a paired t-test over the seeds).

    python -m experiments.ablate                 # `make ablate`: every row x seed, the bandit,
                                                 # the tables, the figures
    python -m experiments.ablate --report-only   # the table and figure again from the runs
    python -m experiments.ablate --rows 1 2 --seeds 0   # DAPO against no clip-higher, one seed
    python -m experiments.ablate --set lr=1e-4   # change a dapo.Config field for every row

Writes out_dir/base-model/ (the base model, its tokenizer and the task's rows: every run's --model
and data), out_dir/row{N}/seed{S}/ (metrics.jsonl, the final checkpoint, probe.json, run.json,
log.txt), out_dir/table.md, out_dir/ablation.png, and clip-higher in isolation (ablate_isolated.py):
out_dir/clip_bandit.json and clip_bandit.png. The final checkpoint of each run is probed on the
held-out problems (probe.json): k samples per problem, read for what the logged metrics cannot say
(distinct right answers, filler repeated, working shown). docs/ablation.md discusses one run of it.
"""
import argparse
import concurrent.futures
import contextlib
import itertools
import json
import multiprocessing
import os
import shutil
import statistics
import time
from dataclasses import MISSING, asdict, dataclass, field, fields, replace

import torch

import dapo
from experiments import ablate_isolated, ablate_toy
from experiments.plot import read_metrics, series
from infra.precision import resolve as resolve_precision

TECHNIQUES = ("clip_higher", "dynamic_sampling", "loss_agg_mode", "overlong_shaping",
              "overlong_filtering")

# The settings every row shares (dapo.Config fields): 32 prompts x 4 responses per rollout step, and
# the paper's 16 optimizer steps per rollout (2 prompts' groups each), so the policy moves between
# the first and the last one and the clip has something to bind (it still binds on only ~0.3% of the
# tokens: docs/ablation.md). Groups of 4 (the paper: 16) make groups whose answers all agree common,
# as they are at scale once a model solves most of its training problems; the 128 responses per step
# cost what 16 x 8 would.
REGIME = dict(group_size=4, train_prompts=32, gen_prompts=48, max_gen_batches=4,
              mini_batch_prompts=2, max_response_len=ablate_toy.ABL_MAX_RESPONSE_LEN,
              overlong_buffer=ablate_toy.ABL_OVERLONG_BUFFER, lr=3e-4, warmup_steps=2,
              eval_every=0)


@dataclass
class Metric:
    key: str  # in summarize()'s output
    label: str
    # the paper's direction for DAPO against the row without the technique: "higher" or "lower"
    better: str
    fmt: str = ".3f"


@dataclass
class Row:
    label: str
    switches: dict  # the dapo.Config fields this row changes from DAPO's defaults
    judged_on: list = field(default_factory=list)  # Metric, the quantities the technique acts on
    section: str = ""


ROWS = [
    Row("DAPO", {}),
    Row("no clip-higher", dict(clip_higher=False),
        [Metric("entropy", "entropy (nats/token)", "higher"),
         Metric("distinct", "distinct right answers / problem", "higher", ".2f")], "3.1"),
    Row("no dynamic sampling", dict(dynamic_sampling=False),
        [Metric("steps_to_target", "steps to rollout accuracy {target:g}", "lower", ".1f"),
         Metric("signal_groups", "groups with signal / step", "higher", ".1f")], "3.2"),
    Row("no token-level loss", dict(loss_agg_mode="seq-mean-token-mean"),
        [Metric("length", "response length (tokens)", "lower", ".1f"),
         Metric("repeats", "filler repeats / response (final policy)", "lower", ".2f"),
         Metric("truncated", "responses rambling past the limit", "lower")], "3.3"),
    Row("no overlong shaping", dict(overlong_shaping=False),
        [Metric("truncated", "truncated responses", "lower", ".3f"),
         Metric("val_acc", "held-out accuracy", "higher")], "3.4"),
]


@dataclass
class AblateConfig:
    out_dir: str = field(default="runs/ablate",
                         metadata={"help": "the runs, table.md and ablation.png go here"})
    steps: int = field(default=24, metadata={"help": "rollout steps of every run"})
    seeds: list = field(default_factory=lambda: [0, 1, 2, 3, 4, 5],
                        metadata={"help": "one run per seed and row; a seed fixes the data order "
                                          "and the sampling"})
    rows: list = field(default_factory=lambda: list(range(1, len(ROWS) + 1)),
                       metadata={"help": "rows to run or report (1 = DAPO)"})
    base_seed: int = field(default=0,
                           metadata={"help": "the seed of the base model every run starts from"})
    target_acc: float = field(default=0.7,
                              metadata={"help": "report the steps to this rollout accuracy"})
    window: int = field(default=3, metadata={"help": "moving average over this many steps "
                                                     "(curves and target)"})
    probe_samples: int = field(default=8,
                               metadata={"help": "samples per held-out problem in the final probe"})
    set: list = field(default_factory=list,
                      metadata={"help": "dapo.Config fields for every row, as name=value"})
    jobs: int = field(default=2,
                      metadata={"help": "runs at once, one process and one torch thread each"})
    report_only: bool = field(default=False,
                              metadata={"help": "rebuild the table and figure from finished runs"})


def parse_args(argv=None) -> AblateConfig:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(AblateConfig):
        default = f.default_factory() if f.default is MISSING else f.default
        if isinstance(default, bool):
            kind = dict(action=argparse.BooleanOptionalAction)
        elif isinstance(default, list):
            # the items' type from the default (an empty list holds strings)
            kind = dict(nargs="*", type=type(default[0]) if default else str)
        else:
            kind = dict(type=type(default))
        p.add_argument("--" + f.name.replace("_", "-"), **kind, default=default,
                       help=f.metadata["help"] + " (default: %(default)r)")
    return AblateConfig(**vars(p.parse_args(argv)))


def parse_overrides(pairs):
    """["name=value", ...] -> {name: value}, typed as dapo.Config's fields."""
    types = {f.name: type(f.default) for f in fields(dapo.Config)}
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        name = name.strip().lstrip("-").replace("-", "_")
        if not sep or name not in types:
            raise SystemExit(f"--set {pair!r}: expected name=value with a field of dapo.Config")
        if name in TECHNIQUES + ("seed", "steps", "out_dir", "resume", "eval_only", "model",
                                 "train_data", "val_data"):
            raise SystemExit(f"--set {name}: the ablation sets this itself (rows, --seeds, "
                             "--steps, --out-dir, the base model and the task)")
        if types[name] is tuple:  # report_to=tensorboard,wandb
            out[name] = tuple(v.strip() for v in value.split(",") if v.strip())
        elif types[name] is bool:
            if value.lower() not in ("true", "false", "1", "0"):
                raise SystemExit(f"--set {pair!r}: a switch takes true or false")
            out[name] = value.lower() in ("true", "1")
        else:
            out[name] = types[name](value)
    return out


def run_dir(out_dir, row, seed):
    return os.path.join(out_dir, f"row{row}", f"seed{seed}")


def run_config(acfg, row, seed) -> dapo.Config:
    """DAPO's defaults, then REGIME, then --set, then the row's switch: nothing else differs between
    rows."""
    base = os.path.join(acfg.out_dir, "base-model")
    return dapo.Config(**{**REGIME, **parse_overrides(acfg.set), **ROWS[row - 1].switches,
                          "model": base, "train_data": os.path.join(base, "train.jsonl"),
                          "val_data": os.path.join(base, "test.jsonl"), "seed": seed,
                          "steps": acfg.steps, "out_dir": run_dir(acfg.out_dir, row, seed),
                          "overwrite": True})


def prepare_base_model(acfg):
    """The base model (trained once per base seed, then cached in runs/ablate-base), the demo's
    tokenizer and the task's rows, in one Hugging Face model directory: every run loads it."""
    from toy import make_toy_tokenizer
    path = os.path.join(acfg.out_dir, "base-model")
    model = ablate_toy.ablation_base_model(make_toy_tokenizer(path), seed=acfg.base_seed)
    model.save_pretrained(path)  # the weights and config.json, beside the tokenizer files
    ablate_toy.write_rows(os.path.join(path, "train.jsonl"), ablate_toy.ablation_rows("train"))
    ablate_toy.write_rows(os.path.join(path, "test.jsonl"), ablate_toy.ablation_rows("test"))
    return path


def train_and_probe(acfg, row, seed):
    """One run, in its own process with one torch thread (two OpenMP threads stall on a shared
    2-core machine); its output goes to log.txt. Returns (row, seed, wall seconds)."""
    torch.set_num_threads(1)
    cfg = run_config(acfg, row, seed)
    shutil.rmtree(cfg.out_dir, ignore_errors=True)
    os.makedirs(cfg.out_dir)
    t0 = time.time()
    with open(os.path.join(cfg.out_dir, "log.txt"), "w") as log, contextlib.redirect_stdout(log), \
            contextlib.redirect_stderr(log):
        dapo.main(cfg)
        # the probe samples in the run's precision (main resolves --precision for itself)
        run = replace(cfg, precision=resolve_precision(cfg.precision, cfg.device))
        result = probe(os.path.join(cfg.out_dir, "checkpoints", f"step_{cfg.steps:06d}", "model"),
                       cfg.val_data, acfg.probe_samples, seed, run)
    with open(os.path.join(cfg.out_dir, "probe.json"), "w") as f:
        json.dump(result, f)
    wall = time.time() - t0
    # written last: marks a finished run
    with open(os.path.join(cfg.out_dir, "run.json"), "w") as f:
        json.dump({"row": row, "seed": seed, "wall_s": wall, "threads": 1,
                   "config": asdict(cfg)}, f)
    return row, seed, wall


@torch.no_grad()
def probe(model_dir, rows_path, k, seed, cfg) -> dict:
    """Sample k responses to every held-out problem with the run's rollout settings (cfg), at
    temperature 1 as the rollouts, and read them: accuracy, how many different right responses
    each problem gets (the diversity clip-higher keeps), filler repeats, truncation, and how often
    the working is shown."""
    from data import load_rows, load_tokenizer
    from model import Transformer
    from reward import Verifier
    tok = load_tokenizer(model_dir)
    model = Transformer.from_pretrained(model_dir, dtype=torch.float32)
    rows = load_rows(rows_path, tok)
    # every sample decoding at once (rollout_slots 0): the draws follow the slots' schedule
    batch = dapo.rollout(model, rows, tok, replace(cfg, rollout_slots=0), Verifier(),
                         group_size=k, temperature=1.0, top_p=1.0, top_k=0,
                         generator=torch.Generator().manual_seed(1000 + seed))
    lengths = batch.response_lengths
    texts = tok.decode_rows(batch.response_ids, lengths)
    right = batch.acc.tolist()
    distinct = [len({t for t, good in zip(texts[i:i + k], right[i:i + k]) if good})
                for i in range(0, len(texts), k)]
    return {"val_acc": statistics.fmean(right), "distinct": statistics.fmean(distinct),
            "repeats": statistics.fmean(ablate_toy.filler_repeats(t) for t in texts),
            "worked": statistics.fmean(ablate_toy.is_worked(t) for t in texts),
            "truncated": batch.truncated.float().mean().item(),
            "length": lengths.float().mean().item(), "samples": k, "problems": len(rows)}


def run_all(acfg):
    """The clip-higher bandit (ablate_isolated.py, ~1 min) beside the base model's warm-up (cached
    after the first time), then every (row, seed), acfg.jobs at a time; seeds outermost, so a
    session cut short leaves whole seeds."""
    # a fresh interpreter: no OpenMP state shared with this one
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(acfg.jobs, mp_context=spawn) as pool:
        bandit = pool.submit(ablate_isolated.run, acfg.out_dir)
        torch.set_num_threads(1)
        prepare_base_model(acfg)
        todo = [(row, seed) for seed in acfg.seeds for row in acfg.rows]
        futures = [pool.submit(train_and_probe, acfg, row, seed) for row, seed in todo]
        print(f"clip-higher in isolation: {bandit.result()}", flush=True)
        for done in concurrent.futures.as_completed(futures):
            row, seed, wall = done.result()
            print(f"row {row} ({ROWS[row - 1].label}), seed {seed}: {wall:.0f} s", flush=True)


# ------------------------------------------------------------------------------------------------
# Reading the runs back

def load_runs(acfg):
    """{(row, seed): (run.json, metrics rows, probe.json)} for the requested rows and seeds that
    finished."""
    runs = {}
    for row, seed in itertools.product(acfg.rows, acfg.seeds):
        path = run_dir(acfg.out_dir, row, seed)
        if not os.path.isfile(os.path.join(path, "run.json")):
            continue
        with open(os.path.join(path, "run.json")) as f:
            info = json.load(f)
        with open(os.path.join(path, "probe.json")) as f:
            probed = json.load(f)
        runs[row, seed] = info, read_metrics(os.path.join(path, "metrics.jsonl")), probed

    def shared(config):
        return {k: v for k, v in config.items() if k not in TECHNIQUES + ("seed", "out_dir")}

    first = next(iter(runs.values()), None)
    # rows are comparable only if nothing but the switches differs
    for (row, seed), (info, _, _) in runs.items():
        diff = {k for k, v in shared(info["config"]).items()
                if shared(first[0]["config"]).get(k) != v}
        if diff:
            raise SystemExit(f"{run_dir(acfg.out_dir, row, seed)} ran with other settings "
                             f"({', '.join(sorted(diff))}) than the other runs: run the ablation "
                             "again, or pick --rows/--seeds")
    return runs


def moving_average(values, window):
    """The trailing mean over the last `window` values (over fewer at the start)."""
    return [statistics.fmean(values[max(0, i + 1 - window):i + 1]) for i in range(len(values))]


def signal_groups(m, dynamic_sampling):
    """Groups with signal (answers not all equal) in the batch a step trained on. Dynamic sampling
    trains only on those; without it the batch is every group generated, and the rollout counts the
    all-right and all-wrong."""
    if dynamic_sampling:
        return m["train/groups_kept"]
    return m["train/groups_kept"] * (1 - m["rollout/frac_all_correct"]
                                     - m["rollout/frac_all_wrong"])


def summarize(metrics, probed, config, target_acc, window):
    """One run's numbers; a quantity logged per step is its mean over the run (a technique acts
    while its failure is there, early or late). Steps to target: the first step at which the moving
    average of the rollout accuracy (on fresh training prompts, every response generated counted)
    reaches target_acc; a run that never does counts as steps + 1 (and "reached" says so)."""
    rollouts = [m for m in metrics if "rollout/acc" in m]
    steps = [m["step"] for m in rollouts]
    smooth = moving_average([m["rollout/acc"] for m in rollouts], window)
    hit = next((i for i, a in enumerate(smooth) if a >= target_acc), None)
    generated = list(itertools.accumulate(
        (m["train/groups_kept"] + m["train/groups_filtered"] + m.get("train/groups_surplus", 0))
        * config["group_size"] for m in rollouts))
    return {
        "entropy": statistics.fmean(series(rollouts, "actor/entropy")[1]),
        "distinct": probed["distinct"],
        "steps_to_target": steps[hit] if hit is not None else steps[-1] + 1,
        "reached": hit is not None,
        "responses_to_target": generated[hit] if hit is not None else None,
        "signal_groups": statistics.fmean(signal_groups(m, config["dynamic_sampling"])
                                          for m in rollouts),
        "length": statistics.fmean(m["rollout/response_length/mean"] for m in rollouts),
        "repeats": probed["repeats"],
        "truncated": statistics.fmean(m["rollout/truncated"] for m in rollouts),
        "val_acc": probed["val_acc"], "worked": probed["worked"],
        "clip_high": statistics.fmean(m.get("dapo/clipfrac_high", 0.0) for m in rollouts),
        "responses": generated[-1],
    }


# ------------------------------------------------------------------------------------------------
# The statistics and the table

# Student's t, two-sided 95%, by degrees of freedom (seeds - 1): with 6 seeds a difference must be
# 2.57 standard errors
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23,
       11: 2.20, 12: 2.18, 13: 2.16, 14: 2.14, 15: 2.13, 16: 2.12, 17: 2.11, 18: 2.10, 19: 2.09,
       20: 2.09, 25: 2.06, 30: 2.04}


def t95(df):
    # between table entries: the larger, stricter value
    return T95.get(df) or T95[max(k for k in T95 if k < df)]


def paired(dapo_values, row_values, better):
    """DAPO minus the row, seed by seed, signed so that > 0 is the paper's direction -> (mean,
    standard error, t, verdict), the verdict a two-sided paired t-test at 95% over the seeds."""
    seeds = sorted(set(dapo_values) & set(row_values))
    sign = 1 if better == "higher" else -1
    diffs = [sign * (dapo_values[s] - row_values[s]) for s in seeds]
    if len(diffs) < 2:
        return ((diffs[0] if diffs else float("nan")), float("nan"), float("nan"),
                f"{len(diffs)} seed(s): no test")
    mean, se = statistics.fmean(diffs), statistics.stdev(diffs) / len(diffs) ** 0.5
    t = mean / se if se > 0 else (float("inf") if mean > 0 else float("-inf") if mean < 0 else 0.0)
    crit = t95(len(diffs) - 1)
    verdict = "yes" if t > crit else "opposite, beyond noise" if t < -crit else "within noise"
    return mean, se, t, verdict


def build_table(summaries, acfg, caption=""):
    """summaries {row: {seed: summarize(...)}} -> markdown: one line per (technique, quantity it
    acts on)."""
    head = ["technique (paper)", "judged on", "DAPO", "without it",
            "difference (+: the paper's direction)", "t", "paper's direction, beyond noise?"]
    lines = ([caption, ""] if caption else []) + ["| " + " | ".join(head) + " |",
                                                  "|" + "---|" * len(head)]
    dapo_runs = summaries.get(1, {})
    for row in sorted(summaries):
        spec = ROWS[row - 1]
        for metric in spec.judged_on:
            a = {s: v[metric.key] for s, v in dapo_runs.items()}
            b = {s: v[metric.key] for s, v in summaries[row].items()}
            mean, se, t, verdict = paired(a, b, metric.better)
            cells = [_mean_sd(a.values(), metric.fmt), _mean_sd(b.values(), metric.fmt)]
            # a run that never reaches the target counts as steps + 1
            if metric.key == "steps_to_target":
                cells = [f"{c} ({sum(r['reached'] for r in runs.values())}/{len(runs)} reach it)"
                         for c, runs in zip(cells, (dapo_runs, summaries[row]))]
            lines.append("| " + " | ".join([
                f"{spec.label.replace('no ', '')} (Sec. {spec.section})",
                metric.label.format(target=acfg.target_acc), *cells,
                f"{mean:+{metric.fmt}} ± {se:{metric.fmt}}", f"{t:.1f}", verdict]) + " |")
    return "\n".join(lines)


def _mean_sd(values, fmt):
    values = list(values)
    if not values:
        return "-"
    return f"{statistics.fmean(values):{fmt}}" + (f" ± {statistics.stdev(values):{fmt}}"
                                                  if len(values) > 1 else "")


def build_overview(summaries, acfg):
    """Every row on every quantity (mean over seeds): what switching one technique off does to the
    others' numbers."""
    cols = [("val_acc", "held-out acc", ".3f"), ("entropy", "entropy", ".3f"),
            ("distinct", "distinct right", ".2f"),
            ("steps_to_target", f"steps to {acfg.target_acc:g}", ".1f"),
            ("signal_groups", "signal groups", ".1f"), ("length", "length", ".1f"),
            ("repeats", "filler repeats", ".2f"), ("truncated", "truncated", ".3f"),
            ("worked", "working shown", ".2f"), ("clip_high", "clipped high", ".4f"),
            ("responses", "generated", ".0f")]
    lines = ["| row | " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * (len(cols) + 1)]
    for row in sorted(summaries):
        runs = summaries[row].values()
        lines.append(f"| {row}. {ROWS[row - 1].label} | " + " | ".join(
            f"{statistics.fmean(r[key] for r in runs):{fmt}}" for key, _, fmt in cols) + " |")
    return "\n".join(lines)


def build_bandit_table(path):
    """The clip-higher bandit's judged numbers (ablate_isolated.py), paired by seed like the
    runs."""
    with open(path) as f:
        bandit = json.load(f)
    head = ["clip-higher in isolation", "eps_high = 0.28", "eps_high = 0.2",
            "difference (+: the paper's direction)", "t", "paper's direction, beyond noise?"]
    lines = [f"The one-step policy of ablate_isolated.py, {bandit['seeds']} seeds, paired:", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in bandit["rows"]:
        mean, se, t, verdict = paired(dict(enumerate(row["raised"])),
                                      dict(enumerate(row["symmetric"])), row["better"])
        lines.append(f"| {row['label']} | {statistics.fmean(row['raised']):.2f} | "
                     f"{statistics.fmean(row['symmetric']):.2f} | {mean:+.2f} ± {se:.2f} | "
                     f"{t:.1f} | {verdict} |")
    return "\n".join(lines)


def caption(runs, acfg):
    walls = [info["wall_s"] for info, _, _ in runs.values()]
    seeds = sorted({s for _, s in runs})
    return (f"{len(seeds)} seeds ({', '.join(map(str, seeds))}) x {acfg.steps} rollout steps per "
            f"row; one run took {statistics.median(walls) / 60:.1f} min (median of {len(walls)}, "
            f"one torch thread). Paired over seeds: mean ± standard error of the per-seed "
            f"difference, two-sided t-test at 95% " + (
                f"(t > {t95(len(seeds) - 1)} with {len(seeds) - 1} degrees of freedom)."
                if len(seeds) > 1 else "(one seed: no test)."))


# ------------------------------------------------------------------------------------------------
# The figure: each technique's quantity, DAPO against the row without it, mean over seeds

PANELS = [  # (row without the technique, metric logged per step, title)
    (2, "actor/entropy", "clip-higher: entropy (nats/token)"),
    (2, "rollout/acc", "clip-higher: rollout accuracy"),
    (3, "rollout/acc", "dynamic sampling: rollout accuracy"),
    (3, "signal_groups", "dynamic sampling: groups with signal per step"),
    (4, "rollout/response_length/mean", "token-level loss: response length"),
    (4, "rollout/truncated", "token-level loss: responses rambling past the limit"),
    (5, "rollout/truncated", "overlong shaping: truncated responses"),
]


def curve(runs_of_row, key, window):
    """Mean over seeds at each step (smoothed), and the min and max over seeds."""
    per_seed = []
    for info, metrics, _ in runs_of_row:
        rollouts = [m for m in metrics if "rollout/acc" in m]
        if key == "signal_groups":
            ys = [signal_groups(m, info["config"]["dynamic_sampling"]) for m in rollouts]
        else:
            ys = [m[key] for m in rollouts]
        per_seed.append(moving_average(ys, window))
    n = min(len(y) for y in per_seed)
    cols = [[y[i] for y in per_seed] for i in range(n)]
    return (list(range(1, n + 1)), [statistics.fmean(c) for c in cols], [min(c) for c in cols],
            [max(c) for c in cols])


def plot_ablation(runs, summaries, acfg, out):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("ablate.py draws its figure with matplotlib: "
                         "pip install -r requirements.txt") from None
    fig, axes = plt.subplots(2, 4, figsize=(20, 8.5))
    for ax, (row, key, title) in zip(axes.flat, PANELS):
        for r, color in ((1, "black"), (row, f"C{row - 1}")):
            of_row = [v for (rr, _), v in sorted(runs.items()) if rr == r]
            if not of_row:
                continue
            x, y, lo, hi = curve(of_row, key, acfg.window)
            ax.plot(x, y, color=color, linewidth=2 if r == 1 else 1.4, label=ROWS[r - 1].label)
            ax.fill_between(x, lo, hi, color=color, alpha=0.1, linewidth=0)
        if key == "rollout/acc":
            ax.axhline(acfg.target_acc, color="gray", linestyle=":", linewidth=1)
        ax.set_title(title + (f", {acfg.window}-step mean" if acfg.window > 1 else ""), fontsize=10)
        ax.set_xlabel("rollout step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes.flat[len(PANELS)]  # the final policies, probed on held-out problems: one dot per seed
    rows = sorted(summaries)
    for r in rows:
        accs = [s["val_acc"] for s in summaries[r].values()]
        color = "black" if r == 1 else f"C{r - 1}"
        ax.bar(r, statistics.fmean(accs), color=color, alpha=0.35)
        ax.plot([r] * len(accs), accs, "o", color=color, markersize=4)
    ax.set_xticks(rows, [ROWS[r - 1].label.replace("no ", "no\n") for r in rows], fontsize=7)
    ax.set_title(f"held-out accuracy of the final policies ({acfg.probe_samples} samples/problem)",
                 fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    n_seeds = len({s for _, s in runs})
    fig.suptitle(f"DAPO against DAPO without one technique, toy scale: mean of {n_seeds} seeds, "
                 "band = min..max")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def report(acfg):
    runs = load_runs(acfg)
    if not runs:
        raise SystemExit(f"no finished run under {acfg.out_dir} for rows {acfg.rows} "
                         f"and seeds {acfg.seeds}")
    summaries = {}
    for (row, seed), (info, metrics, probed) in sorted(runs.items()):
        summaries.setdefault(row, {})[seed] = summarize(metrics, probed, info["config"],
                                                        acfg.target_acc, acfg.window)
    text = (build_table(summaries, acfg, caption(runs, acfg)) + "\n\n"
            + build_overview(summaries, acfg))
    bandit = os.path.join(acfg.out_dir, "clip_bandit.json")
    if os.path.isfile(bandit):
        text += "\n\n" + build_bandit_table(bandit)
    with open(os.path.join(acfg.out_dir, "table.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    out = plot_ablation(runs, summaries, acfg, os.path.join(acfg.out_dir, "ablation.png"))
    print(f"\nwrote {os.path.join(acfg.out_dir, 'table.md')} and {out}")
    return summaries


def main(acfg: AblateConfig):
    if not acfg.rows or not set(acfg.rows) <= set(range(1, len(ROWS) + 1)):
        raise SystemExit(f"--rows: numbers from 1 to {len(ROWS)}")
    parse_overrides(acfg.set)  # a typo fails now, not after the first run
    if not acfg.report_only:
        t0 = time.time()
        run_all(acfg)
        print(f"{len(acfg.rows) * len(acfg.seeds)} runs in {(time.time() - t0) / 60:.1f} min",
              flush=True)
    report(acfg)


if __name__ == "__main__":
    main(parse_args())
