"""
The paper's Table 1 widened with DAPO's neighbours, on the real model: make real's run
(experiments/real.py: SmolLM2-135M-Instruct learning sums, 4 optimizer steps per rollout) with
DAPO's loss, and with each answer the field gave since in its place, several seeds each, make
real's 8 steps.

    arm              dapo.py flags (the rest: make real's settings, DAPO's techniques on)
    dapo             none
    naive-grpo       all four techniques off: --loss-agg-mode seq-mean-token-mean
                     --no-clip-higher --no-dynamic-sampling --no-overlong-shaping (Table 1's row)
    dr-grpo          --scale-rewards none --loss-agg-mode seq-mean-token-sum-norm (arXiv
                     2503.20783: no std, a constant denominator)
    gspo             --loss-mode gspo --eps-low 3e-4 --eps-high 4e-4 --loss-agg-mode
                     seq-mean-token-mean (arXiv 2507.18071: its paper's clip range and mean)
    cispo            --loss-mode cispo --eps-low 0.99 (arXiv 2506.13585: no lower bound on the
                     weight in effect; the upper one DAPO's 0.28)
    kl-cov           --loss-mode kl_cov (arXiv 2505.22617, verl's defaults: --kl-cov-ratio 2e-4,
                     --ppo-kl-coef 0.1; at this size one token a micro-batch)
    no-clip-higher   --no-clip-higher (the symmetric clip)

    python -m experiments.real_neighbours                  # 7 arms x 3 seeds, 2 runs at a time
    python -m experiments.real_neighbours --arms dapo gspo --seeds 0
    python -m experiments.real_neighbours --report-only    # the table and figure of the runs made

Each run is real_ablate.py's: `python dapo.py` on one CPU thread, kept when finished. Then the
final policy answers the 64 held-out problems 4 times each at the evaluation's settings, and the
mean length of its wrong and right answers is kept (lengths.json): Dr. GRPO's claim is that the
std and the per-response length normalisation let wrong answers grow long. Writes
out_dir/ARM-seedS/, out_dir/table.md and out_dir/neighbours.png; docs/real_model.md discusses
one run of it.
"""
import json
import os
import statistics
from dataclasses import replace

import torch

from config import parse_args
from data import encode_prompts, load_tokenizer
from examples import smollm2, sums
from experiments import real, real_ablate
from experiments.plot import read_metrics
from experiments.real_ablate import generated_by_step, mean_of, points, run_dapo, spread
from infra import memory, precision
from model import ModelConfig, Transformer
from sampler import generate

ARMS = {
    "dapo": [],
    "naive-grpo": ["--loss-agg-mode", "seq-mean-token-mean", "--no-clip-higher",
                   "--no-dynamic-sampling", "--no-overlong-shaping"],
    "dr-grpo": ["--scale-rewards", "none", "--loss-agg-mode", "seq-mean-token-sum-norm"],
    "gspo": ["--loss-mode", "gspo", "--eps-low", "3e-4", "--eps-high", "4e-4",
             "--loss-agg-mode", "seq-mean-token-mean"],
    "cispo": ["--loss-mode", "cispo", "--eps-low", "0.99"],
    "kl-cov": ["--loss-mode", "kl_cov"],
    "no-clip-higher": ["--no-clip-higher"],
}
# make real's shape, its 8 steps and its evaluations (steps 0, 4, 8) included: at ~2 minutes of
# CPU a step in fp32 (a CPU without native bf16), 21 runs of 12 steps would take most of a day
STEPS, EVAL_EVERY = real.SETTINGS["steps"], real.SETTINGS["eval_every"]


def run_dir(out_dir: str, arm: str, seed: int) -> str:
    return real_ablate.run_dir(out_dir, arm, seed)


def finished(directory: str) -> bool:
    return real_ablate.finished(directory, STEPS) and os.path.isfile(
        os.path.join(directory, "lengths.json"))


def train(model_dir: str, task: real.Task, out_dir: str, arm: str, seed: int) -> float:
    """One run of the arm (skipped when its metrics are complete) -> its CPU seconds."""
    directory = run_dir(out_dir, arm, seed)
    if real_ablate.finished(directory, STEPS):
        return cpu_seconds(directory)
    flags = ["--steps", str(STEPS), "--eval-every", str(EVAL_EVERY), *ARMS[arm]]
    return run_dapo(model_dir, task, directory, seed, flags)[1]


def cpu_seconds(directory: str) -> float:
    with open(os.path.join(directory, "cpu_seconds.txt")) as f:
        return float(f.read())


@torch.no_grad()
def answer_lengths(directory: str, task: real.Task, seed: int) -> dict:
    """The final policy's answers to every held-out problem, eval_samples each at the evaluation's
    temperature and top-p and the run's precision -> the mean response length (tokens, EOS
    included) of the wrong and of the right ones, and their counts; kept in lengths.json."""
    cfg = parse_args(real.dapo_argv("", task, directory, seed))
    model_dir = os.path.join(directory, "checkpoints", f"step_{STEPS:06d}", "model")
    size = memory.parameter_count(ModelConfig.from_json(os.path.join(model_dir, "config.json")))
    cfg = replace(cfg, precision=precision.resolve(cfg.precision, "cpu", size))
    model, tok = Transformer.from_pretrained(model_dir), load_tokenizer(model_dir)
    rows = real.first_rows(task.val, 10_000)
    messages = [{"prompt": [{"role": "user", "content": row["prompt"]}]} for row in rows
                for _ in range(cfg.eval_samples)]
    prompts, _ = encode_prompts(messages, tok, cfg.max_prompt_len)
    with precision.autocast(cfg.precision, "cpu"):
        out = generate(model, prompts, cfg.max_response_len, temperature=cfg.eval_temperature,
                       top_p=cfg.eval_top_p, eos_token_ids=tok.eos_token_ids,
                       pad_token_id=tok.pad_token_id,
                       generator=torch.Generator().manual_seed(seed + 1))
    texts = tok.decode_rows(out.response_ids, out.lengths)
    right = [sums.score(text, row["answer"])["acc"]
             for text, row in zip(texts, [r for r in rows for _ in range(cfg.eval_samples)])]
    lengths = out.lengths.tolist()
    wrong_lengths = [n for n, ok in zip(lengths, right) if not ok]
    right_lengths = [n for n, ok in zip(lengths, right) if ok]
    result = {"wrong_mean": statistics.mean(wrong_lengths) if wrong_lengths else None,
              "right_mean": statistics.mean(right_lengths) if right_lengths else None,
              "wrong": len(wrong_lengths), "right": len(right_lengths)}
    with open(os.path.join(directory, "lengths.json"), "w") as f:
        json.dump(result, f)
    return result


def load(out_dir: str, arm: str, seeds: list[int]) -> list[tuple[list[dict], dict, float]]:
    """(metrics.jsonl's rows, lengths.json, CPU seconds) of each finished run of the arm."""
    out = []
    for seed in seeds:
        directory = run_dir(out_dir, arm, seed)
        if finished(directory):
            with open(os.path.join(directory, "lengths.json")) as f:
                lengths = json.load(f)
            out.append((read_metrics(os.path.join(directory, "metrics.jsonl")), lengths,
                        cpu_seconds(directory)))
    return out


COLUMNS = ["arm", "seeds", "val/acc step 0", f"val/acc step {STEPS}", f"pass@4 step {STEPS}",
           "entropy, last 4 steps", "wrong answers' length", "right answers' length",
           "up-clipped", "down-clipped", "responses generated", "update s/step", "CPU s"]


def table(out_dir: str, arms: list[str], seeds: list[int]) -> str:
    """One row per arm, each figure the mean [min, max] over the seeds finished."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for arm in arms:
        runs = load(out_dir, arm, seeds)

        def each(fn, fmt=".3f"):
            return spread([fn(*run) for run in runs], fmt)
        cells = [arm, str(len(runs)),
                 each(lambda rows, _, __: points(rows, "val/acc")[0][1]),
                 each(lambda rows, _, __: points(rows, "val/acc")[-1][1]),
                 each(lambda rows, _, __: points(rows, "val/pass@4")[-1][1]),
                 each(lambda rows, _, __: mean_of(rows, "actor/entropy", last=4)),
                 each(lambda _, lengths, __: lengths["wrong_mean"] or 0.0, ".1f"),
                 each(lambda _, lengths, __: lengths["right_mean"] or 0.0, ".1f"),
                 each(lambda rows, _, __: mean_of(rows, "dapo/clipfrac_high"), ".4f"),
                 each(lambda rows, _, __: mean_of(rows, "dapo/clipfrac_low"), ".4f"),
                 each(lambda rows, _, __: max(generated_by_step(rows, ARMS[arm]).values()), ".0f"),
                 each(lambda rows, _, __: mean_of(rows, "timing/train_s"), ".1f"),
                 each(lambda _, __, cpu: cpu, ".0f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figure(out_dir: str, arms: list[str], seeds: list[int], path: str) -> str:
    """val/acc and the entropy over the steps, an arm's mean over its seeds as a line and their
    range as a band."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [("val/acc (avg@4, 64 held-out problems)", "val/acc"),
              ("entropy of pi_old (nats/token)", "actor/entropy")]
    fig, axes = plt.subplots(1, len(panels), figsize=(12, 4.2))
    for ax, (title, key) in zip(axes, panels):
        for colour, arm in enumerate(arms):
            curves = [dict(points(rows, key)) for rows, _, _ in load(out_dir, arm, seeds)]
            if not curves:
                continue
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            ys = [[c[s] for c in curves] for s in steps]
            style = "-o" if key == "val/acc" else "-"
            ax.plot(steps, [statistics.mean(y) for y in ys], style, color=f"C{colour}",
                    markersize=3, label=f"{arm} ({len(curves)})")
            ax.fill_between(steps, [min(y) for y in ys], [max(y) for y in ys],
                            color=f"C{colour}", alpha=0.12)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None):
    args = real_ablate.parse_args(__doc__, "runs/real_neighbours", list(ARMS), argv)
    task = real.Task(*sums.write_task(os.path.join(args.out_dir, "data")))
    if not args.report_only:
        model_dir = smollm2.ensure_model(smollm2.OUT)
        todo = [(arm, seed) for seed in args.seeds for arm in args.arms
                if not finished(run_dir(args.out_dir, arm, seed))]
        failed = real_ablate.make_runs(
            lambda arm, seed: train(model_dir, task, args.out_dir, arm, seed), todo, args.jobs,
            "s of CPU")
        torch.set_num_threads(1)
        for arm, seed in todo:  # one at a time: seconds each
            if (arm, seed) not in failed:
                answer_lengths(run_dir(args.out_dir, arm, seed), task, seed)
    text = table(args.out_dir, args.arms, args.seeds)
    with open(os.path.join(args.out_dir, "table.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    print("figure:", figure(args.out_dir, args.arms, args.seeds,
                            os.path.join(args.out_dir, "neighbours.png")))


if __name__ == "__main__":
    main()
