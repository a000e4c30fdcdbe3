"""
Two of the paper's figures on the real model: make real's run (experiments/real.py: SmolLM2-135M-
Instruct learning sums, 4 optimizer steps per rollout), and the same with one technique switched
off, several seeds each.

- clip-higher (the paper's Fig. 2): entropy and val/acc over the steps, eps_high 0.28 against the
  symmetric clip (eps_high = eps_low = 0.2, `--no-clip-higher`). The paper's claim: with the
  symmetric clip the entropy collapses and the accuracy stalls.
- dynamic sampling (the idea of the paper's Fig. 6): val/acc against the responses generated so
  far, with dynamic sampling and without (`--no-dynamic-sampling`: every group trains, the
  all-right and all-wrong ones with zero advantage). A step with it costs more samples; the
  question is whether the accuracy per sample generated is better.

    python -m experiments.real_ablate                    # 3 arms x 3 seeds, 2 runs at a time
    python -m experiments.real_ablate --seeds 0 1 --arms dapo no-clip-higher
    python -m experiments.real_ablate --report-only      # the table and figure of the runs made

Each run is `python dapo.py` with real.py's flags on one CPU thread (its command is the first line
of its log.txt); a run that finished is kept, not run again. Writes out_dir/ARM-seedS/ (the run),
out_dir/table.md and out_dir/real_ablate.png. docs/real_model.md discusses one run of it.
"""
import argparse
import concurrent.futures
import os
import statistics
import subprocess
import sys
import time

from examples import smollm2, sums
from experiments import real
from experiments.plot import read_metrics, series

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def points(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of each row that has the metric."""
    return list(zip(*series(rows, key)))

ARMS = {  # name: the dapo.py flags that switch its technique off
    "dapo": [],
    "no-clip-higher": ["--no-clip-higher"],
    "no-dynamic-sampling": ["--no-dynamic-sampling"],
}
STEPS = 12  # make real's 8, and 4 more: a collapse of the entropy takes steps to show
EVAL_EVERY = 4
COMPARED = {"clip-higher": ("dapo", "no-clip-higher"),
            "dynamic sampling": ("dapo", "no-dynamic-sampling")}


def run_dir(out_dir: str, arm: str, seed: int) -> str:
    return os.path.join(out_dir, f"{arm}-seed{seed}")


def finished(directory: str, steps: int = STEPS) -> bool:
    """dapo.py writes the last step's checkpoint after the step's metrics, then the final
    evaluation: the run is done when that evaluation's row is in metrics.jsonl."""
    path = os.path.join(directory, "metrics.jsonl")
    return os.path.isfile(path) and any(r.get("step") == steps and "val/acc" in r
                                        for r in read_metrics(path))


def run(model_dir: str, task: real.Task, out_dir: str, arm: str, seed: int) -> float:
    """One run of an arm -> its wall time in seconds."""
    return run_dapo(model_dir, task, run_dir(out_dir, arm, seed), seed,
                    ["--steps", str(STEPS), "--eval-every", str(EVAL_EVERY), *ARMS[arm]])[0]


def run_dapo(model_dir: str, task: real.Task, directory: str, seed: int,
             flags: list[str]) -> tuple[float, float]:
    """One dapo.py run with real.py's settings and `flags` on one thread, its output in its
    log.txt -> its wall time and CPU time (user + system) in seconds, the CPU time written to
    cpu_seconds.txt beside it."""
    argv = real.dapo_argv(model_dir, task, directory, seed, tuple(flags))
    os.makedirs(directory, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    t0 = time.time()
    with open(os.path.join(directory, "log.txt"), "w") as log:
        log.write("python dapo.py " + " ".join(argv) + "\n")
        log.flush()
        child = subprocess.Popen([sys.executable, os.path.join(ROOT, "dapo.py"), *argv],
                                 cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)  # this child's own CPU time
        child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise SystemExit(f"{directory}: dapo.py exited {child.returncode}; see its log.txt")
    cpu = usage.ru_utime + usage.ru_stime
    with open(os.path.join(directory, "cpu_seconds.txt"), "w") as f:
        f.write(f"{cpu:.1f}\n")
    return time.time() - t0, cpu


def generated_by_step(rows: list[dict], flags: list[str]) -> dict[int, int]:
    """Responses generated before each step's end (step 0: none) by a run with these dapo.py
    flags: generation batches x prompts per batch (--gen-prompts with dynamic sampling,
    --train-prompts without) x G."""
    per_batch = real.SETTINGS["group_size"] * (
        real.SETTINGS["train_prompts"] if "--no-dynamic-sampling" in flags
        else real.SETTINGS["gen_prompts"])
    generated, total = {0: 0}, 0
    for row in rows:
        if "train/num_gen_batches" in row:
            total += row["train/num_gen_batches"] * per_batch
            generated[row["step"]] = total
    return generated


def load(out_dir: str, arm: str, seeds: list[int]) -> list[list[dict]]:
    """metrics.jsonl's rows of each finished run of the arm."""
    return [read_metrics(os.path.join(run_dir(out_dir, arm, s), "metrics.jsonl"))
            for s in seeds if finished(run_dir(out_dir, arm, s))]


def mean_of(rows: list[dict], key: str, last: int = 0) -> float:
    """The metric's mean over the steps that have it (the last `last` of them, if given)."""
    values = [y for _, y in points(rows, key)]
    return statistics.mean(values[-last:] if last else values)


def spread(values: list[float], fmt: str = ".3f") -> str:
    """mean [min, max] over the seeds."""
    if not values:
        return "-"
    return f"{statistics.mean(values):{fmt}} [{min(values):{fmt}}, {max(values):{fmt}}]"


def table(out_dir: str, arms: list[str], seeds: list[int]) -> str:
    """One row per arm: val/acc at the start and the end, the entropy of the last steps, the clip
    fractions, the responses generated, over the seeds finished."""
    lines = ["| arm | seeds | val/acc step 0 | val/acc last | entropy, last 4 steps | "
             "up-clipped tokens | down-clipped tokens | responses generated |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for arm in arms:
        runs = load(out_dir, arm, seeds)

        def per_run(fn):
            return [fn(rows) for rows in runs]
        first = per_run(lambda rows: points(rows, "val/acc")[0][1])
        last = per_run(lambda rows: points(rows, "val/acc")[-1][1])
        entropy = per_run(lambda rows: mean_of(rows, "actor/entropy", last=4))
        high = per_run(lambda rows: mean_of(rows, "dapo/clipfrac_high"))
        low = per_run(lambda rows: mean_of(rows, "dapo/clipfrac_low"))
        samples = per_run(lambda rows: max(generated_by_step(rows, ARMS[arm]).values()))
        lines.append(f"| {arm} | {len(runs)} | {spread(first)} | {spread(last)} | "
                     f"{spread(entropy)} | {spread(high)} | {spread(low)} | "
                     f"{spread(samples).replace('.000', '')} |")
    return "\n".join(lines)


def figure(out_dir: str, arms: list[str], seeds: list[int], path: str) -> str:
    """Three panels, one line per run (a colour per arm): the entropy and val/acc by step
    (clip-higher), and val/acc by the responses generated (dynamic sampling)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [("entropy (nats/token), by step", "actor/entropy", False),
              ("val/acc (avg@4, 64 held-out), by step", "val/acc", False),
              ("val/acc by responses generated", "val/acc", True)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8))
    for ax, (title, key, by_samples) in zip(axes, panels):
        for colour, arm in enumerate(arms):
            for i, rows in enumerate(load(out_dir, arm, seeds)):
                xy = points(rows, key)
                if by_samples:
                    generated = generated_by_step(rows, ARMS[arm])
                    xy = [(generated[x], y) for x, y in xy]
                xs, ys = zip(*xy)
                ax.plot(xs, ys, "-o", color=f"C{colour}", markersize=3, alpha=0.8,
                        label=arm if i == 0 else None)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("responses generated" if by_samples else "step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def parse_args(doc: str, out_dir: str, arms: list[str], argv=None) -> argparse.Namespace:
    """The command line of an experiment of arms x seeds (this one's, real_neighbours.py's)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out-dir", default=out_dir, help="(default: %(default)s)")
    parser.add_argument("--arms", nargs="+", default=arms, choices=arms, help="(default: all)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2],
                        help="(default: %(default)s)")
    parser.add_argument("--jobs", type=int, default=2,
                        help="runs at a time, one thread each (default: %(default)s)")
    parser.add_argument("--report-only", action="store_true",
                        help="the table and figure of the runs already made")
    return parser.parse_args(argv)


def make_runs(run_one, todo: list[tuple[str, int]], jobs: int, unit: str) -> list[tuple[str, int]]:
    """run_one(arm, seed) -> seconds for each (arm, seed), `jobs` at a time; a run that fails
    (SystemExit: its log.txt says why) stops no other -> the runs that failed."""
    print(f"{len(todo)} runs to make, {jobs} at a time", flush=True)
    failed = []
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = {pool.submit(run_one, arm, seed): (arm, seed) for arm, seed in todo}
        for future in concurrent.futures.as_completed(futures):
            arm, seed = futures[future]
            try:
                print(f"{arm} seed {seed}: {future.result():.0f} {unit}", flush=True)
            except SystemExit as e:
                print(f"{arm} seed {seed}: {e}", flush=True)
                failed.append((arm, seed))
    if failed:
        print(f"{len(failed)} runs failed; the same command makes them again", flush=True)
    return failed


def main(argv=None):
    args = parse_args(__doc__, "runs/real_ablate", list(ARMS), argv)
    if not args.report_only:
        model_dir = smollm2.ensure_model(smollm2.OUT)
        task = real.Task(*sums.write_task(os.path.join(args.out_dir, "data")))
        todo = [(arm, seed) for seed in args.seeds for arm in args.arms
                if not finished(run_dir(args.out_dir, arm, seed))]
        make_runs(lambda arm, seed: run(model_dir, task, args.out_dir, arm, seed), todo,
                  args.jobs, "s")
    text = table(args.out_dir, args.arms, args.seeds)
    with open(os.path.join(args.out_dir, "table.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    print("figure:", figure(args.out_dir, args.arms, args.seeds,
                            os.path.join(args.out_dir, "real_ablate.png")))


if __name__ == "__main__":
    main()
