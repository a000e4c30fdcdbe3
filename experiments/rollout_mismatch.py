"""
The sampler/trainer mismatch of a bf16 sampler beside an fp32 trainer, on the demo's policy.

One rollout of --prompts toy prompts x --group-size responses, sampled as dapo.py's rollout()
samples under --rollout-precision bf16 (CPU autocast, the GPU's code path), then scored by the
fp32 trainer's forward; and, for contrast, the same with an fp32 sampler. Prints the
rollout_corr/ metrics of each (infra/rollout_correction.py; docs/metrics.md) and draws the
distribution of log rho = log pi_trainer - log pi_sampler per token and per response, against the
bound --rollout-correction's modes use by default.

    python -m experiments.rollout_mismatch                      # docs/rollout_correction.png
    python -m experiments.rollout_mismatch --model runs/demo/checkpoints/step_000040/model

Needs matplotlib (requirements.txt).
"""
import argparse
import math
import os
from dataclasses import replace

import torch

import dapo
from config import Config
from data import load_tokenizer
from infra.rollout_correction import Stats
from model import Transformer
from logprobs import response_logprobs
from reward import Verifier
from toy import demo_policy, toy_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(model, tok, rows, cfg, sampler_precision: str, seed: int):
    """The sampler's and the trainer's log-probs of one rollout: (log rho (N, R), response
    mask (N, R), the rollout_corr/ and parity metrics)."""
    cfg = replace(cfg, rollout_precision=sampler_precision)
    batch = dapo.rollout(model, rows, tok, cfg, Verifier(), group_size=cfg.group_size,
                         temperature=cfg.temperature, top_p=1.0, top_k=0,
                         generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():  # the trainer: fp32, the whole sequence at once
        train_logp, _ = response_logprobs(model, batch, cfg.temperature, cfg.fused_head)
    stats = Stats()
    stats.add_mismatch(train_logp, batch.rollout_logp, batch.response_mask)
    mask = batch.response_mask
    log_rho = (train_logp.double() - batch.rollout_logp.double()) * mask
    gap = log_rho[mask].abs()
    metrics = stats.result() | {"training/rollout_logp_diff_mean": gap.mean().item(),
                                "training/rollout_logp_diff_max": gap.max().item(),
                                "max |log rho_seq|": log_rho.sum(-1).abs().max().item()}
    return log_rho, mask, metrics


def plot(results, path, c_max):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, level in zip(axes, ("token", "response")):
        widest = 0.0
        for name, (log_rho, mask, _) in results.items():
            values = log_rho[mask] if level == "token" else log_rho.sum(-1)[mask.any(-1)]
            widest = max(widest, values.abs().max().item())
            ax.hist(values.tolist(), bins=81, histtype="step", log=True,
                    label=f"{name} sampler ({len(values)} {level}s)")
        what = "log rho_t per token" if level == "token" else "log rho_seq = sum_t log rho_t"
        ax.set(xlabel=what, ylabel="count (log scale)", xlim=(-1.1 * widest, 1.1 * widest),
               title=f"{level} level: log pi_trainer(fp32) - log pi_sampler")
        if widest < math.log(c_max):  # the bounds would squash the histogram to a line
            ax.text(0.02, 0.95, f"--rollout-is-max {c_max:g}: log rho = {math.log(c_max):.2f},"
                    "\noff this axis", transform=ax.transAxes, va="top", fontsize=8)
        else:
            for bound in (math.log(c_max), -math.log(c_max)):
                ax.axvline(bound, color="k", ls=":", lw=1)
        ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {os.path.relpath(path, ROOT)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="a checkpoint's model directory; empty: the "
                                                    "demo's base model (seed --seed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("-o", "--out", default=os.path.join(ROOT, "docs",
                                                            "rollout_correction.png"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    cfg = Config(group_size=args.group_size, seed=args.seed, device="cpu", precision="fp32")
    if args.model:
        model, tok = Transformer.from_pretrained(args.model), load_tokenizer(args.model)
    else:
        tok_dir, model = demo_policy(os.path.join(ROOT, "runs", "mismatch"), "cpu", args.seed)
        tok = load_tokenizer(tok_dir)
    model.eval()
    rows = toy_rows(args.prompts, seed=args.seed + 1000, split="train")
    results = {name: measure(model, tok, rows, cfg, name, args.seed) for name in ("fp32", "bf16")}
    for name, (_, mask, metrics) in results.items():
        print(f"{name} sampler, fp32 trainer, {int(mask.sum())} tokens:")
        for key, value in metrics.items():
            print(f"  {key:45s} {value:.3g}")
    plot(results, args.out, cfg.rollout_is_max)


if __name__ == "__main__":
    main()
