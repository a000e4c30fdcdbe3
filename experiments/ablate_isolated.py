"""
Clip-higher's mechanism in isolation (paper Sec. 3.1, Fig. 2-3): a one-step policy, a minute on
one CPU thread.

One prompt, ten possible answers, and the policy is a softmax over ten logits. A common mediocre
answer (right 60% of the time) starts with 90% of the probability; four rare good answers (right
90%) start with 0.5% each; five others are right 10% of the time. Each rollout samples 64 groups of
8 answers; dapo.py's group_advantages() and policy_loss() then take the paper's 16 optimizer steps
(Adam) on the logits, with the symmetric clip (eps_high = eps_low = 0.2) or DAPO's raised upper
bound (eps_high = 0.28). This is the paper's argument in its smallest form: once a rare answer's
probability ratio passes 1 + eps_high its tokens stop pushing it up, so with the symmetric clip it
grows by at most ~1.2x per rollout from its own gradient (in log-probability +0.18, while the lower
bound lets it fall by -0.22), with 1.28 by +0.25. Measured (docs/ablation.md): the good answers take
over ~2 rollouts sooner and the entropy is higher while they rise; how many of the four stay in use
at the end does not differ beyond noise.

    python -m experiments.ablate_isolated   # ~1 min: runs/ablate/clip_bandit.png and .json
"""
import argparse
import json
import math
import os
import statistics

import torch

from dapo import group_advantages, policy_loss
from infra.metrics import clip_stats

# chance each answer is right: mediocre, 4 good, 5 poor
RIGHT = torch.tensor([0.6] + [0.9] * 4 + [0.1] * 5)
START = torch.tensor([0.9] + [0.005] * 4 + [0.016] * 5)  # initial probabilities (sum to 1)
GOOD = slice(1, 5)


def run_bandit(eps_high, seed, rollouts=30, groups=64, group_size=8, updates=16, lr=0.05,
               eps_low=0.2) -> dict:
    """One training run of the bandit. Returns per-rollout lists: the probability of the good
    answers, the policy's entropy, how many good answers hold at least 5% probability, and the
    fraction of samples clipped high."""
    gen = torch.Generator().manual_seed(seed)
    logits = START.log().clone().requires_grad_(True)
    opt = torch.optim.Adam([logits], lr=lr)
    out = {"good": [], "entropy": [], "alive": [], "clip_high": []}
    n = groups * group_size
    for _ in range(rollouts):
        # the rollout: pi_old samples, the verifier scores, group advantages (Eq. 9)
        with torch.no_grad():
            old_logp = logits.log_softmax(-1)
            answer = torch.multinomial(old_logp.exp(), n, replacement=True, generator=gen)  # (n,)
            right = torch.rand(n, generator=gen) < RIGHT[answer]
            adv = group_advantages(right.float() * 2 - 1, group_size)  # (n,)
        clipped = 0.0
        rows = n // updates
        for s in range(0, n, rows):  # 16 optimizer steps per rollout, one mini-batch each
            part = slice(s, s + rows)
            # (rows, 1): a response of one token
            logp = logits.log_softmax(-1)[answer[part]][:, None]
            mask = torch.ones_like(logp, dtype=torch.bool)
            old = old_logp[answer[part]][:, None]
            loss = policy_loss(logp, old, adv[part], mask, eps_low, eps_high, denom=rows)
            opt.zero_grad()
            loss.loss.backward()
            opt.step()
            clipped += clip_stats(loss, logp, old, adv[part], mask)["clip_high"].item() / n
        with torch.no_grad():
            p = logits.softmax(-1)
            out["good"].append(p[GOOD].sum().item())
            out["entropy"].append(-(p * p.log()).sum().item())
            out["alive"].append(int((p[GOOD] > 0.05).sum()))
            out["clip_high"].append(clipped)
    return out


def compare(seeds=20, **kw) -> dict:
    """{eps_high: [run per seed]} for the symmetric and the raised upper clip, the same seeds
    (paired)."""
    return {eh: [run_bandit(eh, s, **kw) for s in range(seeds)] for eh in (0.2, 0.28)}


def rollouts_to(values, level):
    """The first rollout (1-based) at which values reach level; one past the end if they never
    do."""
    return next((i + 1 for i, v in enumerate(values) if v >= level), len(values) + 1)


def summarize(results) -> list[dict]:
    """What the bandit is judged on, paired by seed (the same samples' random numbers with either
    clip): how soon the good answers hold half the probability, the entropy while they rise, and how
    many of the four are still in use at the end. Each: mean with 0.28 and with 0.2, and the
    per-seed differences (0.28 - 0.2)."""
    per_run = {
        "rollouts until the good answers hold half the probability": (
            "lower", lambda r: rollouts_to(r["good"], 0.5)),
        "entropy at rollout 10 (nats)": ("higher", lambda r: r["entropy"][9]),
        f"good answers with probability > 5% at rollout {len(results[0.2][0]['good'])}": (
            "higher", lambda r: r["alive"][-1]),
    }
    out = []
    for label, (better, f) in per_run.items():
        raised, symmetric = [f(r) for r in results[0.28]], [f(r) for r in results[0.2]]
        out.append({"label": label, "better": better, "raised": raised, "symmetric": symmetric,
                    "diffs": [a - b for a, b in zip(raised, symmetric)]})
    return out


def plot(results, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = (("good", "probability of the 4 good answers"), ("entropy", "entropy (nats)"),
              ("alive", "good answers with probability > 5%"))
    for ax, (key, title) in zip(axes, panels):
        for eh, color, label in ((0.2, "C1", "symmetric clip, eps_high = 0.2"),
                                 (0.28, "black", "clip-higher, eps_high = 0.28")):
            ys = [[r[key][i] for r in results[eh]] for i in range(len(results[eh][0][key]))]
            x = range(1, len(ys) + 1)
            ax.plot(x, [statistics.fmean(y) for y in ys], color=color, label=label)
            ax.fill_between(x, [statistics.quantiles(y, n=4)[0] for y in ys],
                            [statistics.quantiles(y, n=4)[2] for y in ys], color=color, alpha=0.12,
                            linewidth=0)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("rollout (16 optimizer steps each)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    n = len(results[0.2])
    fig.suptitle(f"clip-higher in isolation: a one-step policy, four rare good answers; mean of "
                 f"{n} seeds, band = quartiles")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def run(out_dir, seeds=20) -> str:
    """The experiment as `make ablate` runs it: out_dir/clip_bandit.json (the judged numbers) and
    clip_bandit.png."""
    torch.set_num_threads(1)
    os.makedirs(out_dir, exist_ok=True)
    results = compare(seeds)
    with open(os.path.join(out_dir, "clip_bandit.json"), "w") as f:
        json.dump({"seeds": seeds, "rows": summarize(results)}, f)
    return plot(results, os.path.join(out_dir, "clip_bandit.png"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=20,
                   help="runs per clip setting, paired by seed (default: 20)")
    p.add_argument("--out-dir", default="runs/ablate", help="clip_bandit.json and .png go here")
    args = p.parse_args(argv)
    print(run(args.out_dir, args.seeds))
    with open(os.path.join(args.out_dir, "clip_bandit.json")) as f:
        for row in json.load(f)["rows"]:
            d = row["diffs"]
            print(f"{row['label']}: 0.28 {statistics.fmean(row['raised']):.2f}, "
                  f"0.2 {statistics.fmean(row['symmetric']):.2f}, "
                  f"paired {statistics.fmean(d):+.2f} ± "
                  f"{statistics.stdev(d) / math.sqrt(len(d)):.2f}")


if __name__ == "__main__":
    main()
