"""Writes notebooks/dapo_step.ipynb from the cells below and executes it (nbclient), so that the
committed notebook carries its outputs and reads on GitHub:

    .venv/bin/python -m notebooks.build

The cells import the project's functions; nothing of the algorithm is copied here."""
import os
import sys

import nbformat
from nbclient import NotebookClient

HERE = os.path.dirname(os.path.abspath(__file__))
PATH = os.path.join(HERE, "dapo_step.ipynb")

CELLS = [
    ("md", """# The pieces of one DAPO step, by looking

DAPO (arXiv 2503.14476) changes four things in GRPO. Each cell below calls the project's own
function (`dapo.py`, `reward.py`, `toy.py`) and shows a picture, with the numbers behind it, in the
order of one step: the toy task and its base model, G responses to one prompt, the group advantage
(Eq. 9), the dynamic-sampling filter (Eq. 11), clip-higher (Eq. 10), the token-level loss
(Eq. 12), the soft overlong punishment (Eq. 13), one policy update, and a short run's curves.
The settings are the demo's (`Config()` in `config.py`), printed where a cell uses them.

`make notebook` opens it in Jupyter (installed into `.venv/` the first time). On a laptop CPU it
runs in under a minute once the demo's base model is cached in `runs/demo-base` (as `make run`
leaves it); on a fresh clone the first cell that needs the model trains it once (the demo's
warm-up, a few minutes on one core)."""),
    ("code", """# Setup. On Colab: fetch the project (DAPO_REPO: its git URL) and its requirements
import os
import subprocess
import sys

if "google.colab" in sys.modules and not os.path.exists("dapo.py"):
    subprocess.run(["git", "clone", "--depth", "1", os.environ["DAPO_REPO"], "dapo"], check=True)
    os.chdir("dapo")
    # Colab has its own Jupyter: it lacks the project's requirements (matplotlib among them)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-r", "requirements.txt"],
                   check=True)
root = os.path.abspath("..") if os.path.basename(os.getcwd()) == "notebooks" else os.getcwd()
sys.path.insert(0, root)
os.chdir(root)  # the demo's paths (runs/demo-base, runs/...) are relative to the project
os.environ.setdefault("OMP_NUM_THREADS", "1")  # a tiny model: one thread is fastest"""),
    ("code", """# The project's functions, and matplotlib for the pictures
from dataclasses import replace

import matplotlib.pyplot as plt
import torch

from batch import groups_to_train
from config import Config, parse_args
from dapo import (group_advantages, keep_groups, policy_loss, rollout, shape_rewards,
                  update_policy)
from data import load_tokenizer
from reward import Verifier, overlong_penalty
from toy import TOY_MAX_DIGIT, TOY_MAX_TERMS, TOY_MIN_TERMS, demo_policy, toy_rows"""),
    ("md", """## The toy task and what the base model does

Sums of a few small digits (`toy.py`), answered as `Answer: N` and scored by the math_dapo
verifier: +1 right, -1 wrong. The base model (a tiny Qwen2, warmed up on noisy responses) can
work a sum out but often guesses instead, and now and then rambles (`Let me check.`) first.
Here: its answers to a few held-out problems, one sample each at the demo's temperature."""),
    ("code", """cfg = parse_args(["--out-dir", "runs/notebook"])  # the demo's settings (config.py)
print(f"the task: sums of {TOY_MIN_TERMS}-{TOY_MAX_TERMS} digits from 0 to {TOY_MAX_DIGIT}; "
      f"temperature {cfg.temperature}, responses of up to {cfg.max_response_len} tokens")
tok_dir, model = demo_policy(cfg.out_dir, cfg.device, cfg.seed)  # cached in runs/demo-base
tok = load_tokenizer(tok_dir)
generator = torch.Generator().manual_seed(0)


def sample(rows, group_size):
    return rollout(model, rows, tok, cfg, Verifier(), group_size=group_size,
                   temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                   generator=generator)


def responses(batch):
    return [tok.decode(ids[:n].tolist()).replace("\\n", " | ")
            for ids, n in zip(batch.response_ids, batch.response_lengths.tolist())]


held_out = toy_rows(6, seed=0, split="test")
base = sample(held_out, group_size=1)
print(f"{'problem':<8} {'sum':>3}  {'right':<5}  base model's response")
for row, text, right in zip(held_out, responses(base), base.acc.tolist()):
    print(f"{row['prompt'][0]['content']:<8} {row['reward_model']['ground_truth']:>3}  "
          f"{str(right):<5}  {text}")"""),
    ("md", """## G responses to one prompt, and their rewards

Algorithm 1, lines 3-5: the policy samples G responses to one training prompt (G is
`--group-size`), the verifier scores each (`score`), and Eq. 13's length penalty is added
(`reward`)."""),
    ("code", """G = cfg.group_size
prompt = toy_rows(1, seed=0)
group = sample(prompt, group_size=G)
group = replace(group, reward=shape_rewards(group.response_lengths, group.score, cfg))
print(f"G = {G} (--group-size); prompt {prompt[0]['prompt'][0]['content']} (sum "
      f"{prompt[0]['reward_model']['ground_truth']})")
print(f"{'#':<2} {'tokens':>6} {'score':>6} {'reward':>7}  response")
for i, text in enumerate(responses(group)):
    print(f"{i:<2} {group.response_lengths[i]:>6} {group.score[i]:>+6.0f} "
          f"{group.reward[i]:>+7.3f}  {text}")"""),
    ("md", """## Eq. 9: the group advantage

Each response's advantage is its reward minus its group's mean, over the group's (unbiased)
standard deviation. On the group above: the right responses get a positive advantage, the wrong
ones a negative one, and the advantages sum to zero."""),
    ("code", """group_adv = group_advantages(group.reward, G)  # (G,)
print(f"{'#':<2} {'right':<5} {'reward':>7} {'advantage':>9}")
for i in range(G):
    print(f"{i:<2} {str(bool(group.acc[i])):<5} {group.reward[i]:>+7.3f} {group_adv[i]:>+9.3f}")
print(f"sum of the advantages: {group_adv.sum():+.2e}")
colors = ["tab:green" if right else "tab:red" for right in group.acc.tolist()]
fig, axes = plt.subplots(1, 2, figsize=(9, 2.8), sharex=True)
axes[0].bar(range(G), group.reward.tolist(), color=colors)
axes[0].set(title="reward (green: right, red: wrong)", xlabel="response")
axes[1].bar(range(G), group_adv.tolist(), color=colors)
axes[1].set(title="advantage (Eq. 9)", xlabel="response")
for ax in axes:
    ax.axhline(0, color="k", lw=0.5)
plt.tight_layout()
plt.show()"""),
    ("md", """## Eq. 11: dynamic sampling keeps the groups with signal

A made-up batch of small groups, reward +1 (right) or -1 (wrong). A group all right or all wrong
has advantage 0 everywhere: it teaches nothing. `keep_groups` looks at correctness (not at the
shaped reward): a group survives iff some but not all of its responses are right, and DAPO
samples more groups until the batch is full of survivors."""),
    ("code", """G_TOY = 4  # the made-up groups' size (the demo's G is cfg.group_size)
rewards = torch.tensor([1., -1, -1, -1,   1, 1, -1, -1,   1, 1, 1, 1,   -1, -1, -1, -1])
acc = rewards > 0
toy_adv = group_advantages(rewards, G_TOY).view(-1, G_TOY)  # (groups, G_TOY)
toy_kept = keep_groups(acc, G_TOY)  # (groups,) bool
verdicts = []
for g, k in enumerate(toy_kept.tolist()):
    n_right = int(acc.view(-1, G_TOY)[g].sum())
    verdicts.append("kept" if k else "dropped")
    print(f"group {g}: {n_right}/{G_TOY} right -> {'kept' if k else 'dropped (no signal)'}, "
          f"advantages {[round(a, 2) for a in toy_adv[g].tolist()]}")
fig, ax = plt.subplots(figsize=(5, 2.8))
ax.imshow(toy_adv, cmap="RdYlGn", vmin=-1.5, vmax=1.5)
for g in range(len(toy_kept)):
    for i in range(G_TOY):
        ax.text(i, g, f"{rewards[g * G_TOY + i]:+.0f}", ha="center", va="center")
ax.set_yticks(range(len(toy_kept)), [f"group {g}: {v}" for g, v in enumerate(verdicts)])
ax.set(xticks=range(G_TOY), xlabel="response (its reward written in; colour: advantage)")
plt.tight_layout()
plt.show()"""),
    ("md", """On one real generation batch (`--gen-prompts` prompts, G responses each): how many of
each group's responses are right, and which groups survive. The dropped ones are all wrong (too
hard for the model now) or all right (already learned)."""),
    ("code", """gen_batch = sample(toy_rows(cfg.gen_prompts, seed=1), group_size=G)
gen_batch = replace(gen_batch, reward=shape_rewards(gen_batch.response_lengths,
                                                    gen_batch.score, cfg))
kept = keep_groups(gen_batch.acc, G)  # (groups,) bool
n_right = gen_batch.acc.view(-1, G).sum(1)  # (groups,)
plt.figure(figsize=(6, 3))
plt.hist([n_right[kept].tolist(), n_right[~kept].tolist()], bins=range(G + 2), align="left",
         stacked=True, label=["kept", "dropped"])
plt.xlabel(f"right responses in the group (of G = {G})")
plt.ylabel("groups")
plt.legend()
plt.tight_layout()
plt.show()
print(f"{cfg.gen_prompts} prompts (--gen-prompts): {int(kept.sum())} groups kept; dropped: "
      f"{int((n_right == 0).sum())} all wrong, {int((n_right == G).sum())} all right")"""),
    ("md", """## Eq. 10: clip-higher

One token, ratio r = pi_theta / pi_old. The loss is `policy_loss` with the demo's eps_low and
eps_high (DAPO decouples the two bounds and raises the upper one) against PPO's and GRPO's
symmetric clip (eps_high = eps_low); its gradient with respect to the log-prob comes from
autograd. Where the gradient is zero (shaded) the token no longer moves."""),
    ("code", """def surrogate(ratio, a, eps_high):
    \"\"\"Each token's objective -l (one per ratio), its gradient w.r.t. its log-prob.\"\"\"
    logp = torch.log(ratio).clone().requires_grad_(True)  # (K,)
    k = len(ratio)
    args = (torch.zeros(k, 1), torch.full((k,), a), torch.ones(k, 1), cfg.eps_low, eps_high)
    policy_loss(logp[:, None], *args, denom=1.0).loss.backward()  # a sum: each token's gradient
    objective = [-policy_loss(logp[i:i + 1, None].detach(), args[0][:1], args[1][:1],
                              args[2][:1], cfg.eps_low, eps_high, denom=1.0).loss.item()
                 for i in range(k)]
    return objective, logp.grad


print(f"eps_low {cfg.eps_low} (--eps-low), eps_high {cfg.eps_high} (--eps-high)")
ratio = torch.linspace(0.5, 1.6, 221)
fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
for ax, a in zip(axes, (1.0, -1.0)):
    for eps_high, style in ((cfg.eps_low, "--"), (cfg.eps_high, "-")):
        objective, grad = surrogate(ratio, a, eps_high)
        line, = ax.plot(ratio, objective, style, label=f"eps_high {eps_high}")
        ax.fill_between(ratio, 0, 1, where=(grad == 0).tolist(), alpha=0.08,
                        color=line.get_color(), transform=ax.get_xaxis_transform())
    ax.set(title=f"A = {a:+} (shaded: zero gradient)", xlabel="ratio r",
           ylabel="objective -l = min(A r, A clip(r))")
    ax.legend()
plt.tight_layout()
plt.show()
for a in (1.0, -1.0):
    for eps_high in (cfg.eps_low, cfg.eps_high):
        _, grad = surrogate(ratio, a, eps_high)
        moving = ratio[grad != 0]
        print(f"A = {a:+}, eps_high {eps_high}: gradient nonzero for r in "
              f"[{moving.min():.3f}, {moving.max():.3f}]")"""),
    ("md", """## Eq. 12: the token-level loss

A short response and a long one, both with advantage 1. Each token's weight is the gradient of
the loss with respect to its log-prob at r = 1. Eq. 12 divides by the mini-batch's token count;
GRPO's per-sample mean divides each response by its own length first."""),
    ("code", """lengths = [4, 16]
mask = torch.zeros(2, max(lengths))
for i, n in enumerate(lengths):
    mask[i, :n] = 1


def token_weights(denom):
    logp = torch.zeros(mask.shape, requires_grad=True)
    policy_loss(logp, torch.zeros(mask.shape), torch.ones(2), mask, cfg.eps_low, cfg.eps_high,
                denom).loss.backward()
    return -logp.grad  # (2, max(lengths))


dapo_w = token_weights(mask.sum())                                  # Eq. 12
grpo_w = token_weights(mask.sum(1, keepdim=True) * len(lengths))    # per-sample mean
print("response  tokens  weight/token Eq.12  GRPO    total Eq.12  GRPO")
for i, n in enumerate(lengths):
    print(f"{['short', 'long'][i]:<9} {n:>6}  {dapo_w[i, 0]:>17.4f} {grpo_w[i, 0]:>6.4f}"
          f"  {dapo_w[i].sum():>11.3f} {grpo_w[i].sum():>5.3f}")
colors = ["tab:blue"] * lengths[0] + ["tab:orange"] * lengths[1]
fig, axes = plt.subplots(1, 2, figsize=(10, 3), sharey=True)
for ax, (title, w) in zip(axes, (("Eq. 12: over the batch's tokens", dapo_w),
                                  ("GRPO: a mean per response", grpo_w))):
    ax.bar(range(sum(lengths)), torch.cat([w[i, :n] for i, n in enumerate(lengths)]),
           color=colors)
    ax.set(title=title, xlabel="token (blue: the short response, orange: the long one)")
    ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
axes[0].set_ylabel("weight of the token")
plt.tight_layout()
plt.show()"""),
    ("md", """## Eq. 13: the soft overlong punishment

No penalty up to L_max - L_cache tokens, then a linear ramp down to -1 at L_max, and -1 beyond.
The demo's L_max is `--max-response-len` and its L_cache `--overlong-buffer` (`--help` gives the
paper's); the bars are the lengths of the generation batch above."""),
    ("code", """max_len, buffer_len = cfg.max_response_len, cfg.overlong_buffer
print(f"L_max = {max_len} (--max-response-len), L_cache = {buffer_len} (--overlong-buffer): "
      f"no penalty up to {max_len - buffer_len} tokens, -1 beyond {max_len}")
x = list(range(max_len + buffer_len // 2 + 1))
fig, ax = plt.subplots(figsize=(6, 3))
ax.hist(gen_batch.response_lengths.tolist(), bins=range(max_len + 2), color="tab:gray",
        alpha=0.4)
ax.set(xlabel="response length (tokens)", ylabel="responses of the generation batch")
penalty = ax.twinx()
penalty.plot(x, [overlong_penalty(n, max_len, buffer_len) for n in x], color="tab:red")
penalty.set_ylabel("penalty added to the reward", color="tab:red")
for at in (max_len - buffer_len, max_len):
    ax.axvline(at, ls=":", color="k")
plt.tight_layout()
plt.show()"""),
    ("md", """## One policy update, and what it logged

Algorithm 1, lines 9-11, on the groups kept above: the group advantages (Eq. 9), then
`update_policy`, one optimizer step per mini-batch of `--mini-batch-prompts` groups, with
clip-higher and the token-level loss. The row it returns goes into the run's metrics.jsonl
(docs/metrics.md says what each one means)."""),
    ("code", """n_trained = groups_to_train(int(kept.sum()), cfg)
train_batch = gen_batch.groups(kept.nonzero().flatten()[:n_trained].tolist())
train_batch = replace(train_batch, adv=group_advantages(train_batch.reward, G))
opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
logged = update_policy(model, opt, train_batch, cfg)
print(f"trained on {n_trained} groups ({len(train_batch)} responses), "
      f"{cfg.mini_batch_prompts} per optimizer step (--mini-batch-prompts), lr {cfg.lr}")
for key, value in logged.items():
    print(f"{key:<24} {value:.4g}")"""),
    ("md", """## A short run and its curves

`dapo.main` on the demo for a few steps (`make run` runs the whole demo), then
`experiments/plot.py`'s figure of its metrics.jsonl. With this few steps the curves are noisy:
the README's demo shows the trend. The learning rate warms up from 0 at the first step, as
verl's schedule does: that step changes no weight."""),
    ("code", """import contextlib
import io
import json

from IPython.display import Image

import dapo
from experiments.plot import plot

steps = 10
run = parse_args(["--out-dir", "runs/notebook", "--overwrite", "--steps", str(steps),
                  "--eval-every", "5", "--eval-prompts", "64", "--warmup-steps", "1"])
with contextlib.redirect_stderr(io.StringIO()):  # the progress bar: a stderr line per step here
    dapo.main(run)
metrics = os.path.join(run.out_dir, "metrics.jsonl")
with open(metrics) as f:
    rows = [json.loads(line) for line in f]
lrs = [row["actor/lr"] for row in rows if "actor/lr" in row]
print(f"{steps} of the demo's {Config().steps} steps; the lr at each step (--lr {run.lr}, "
      f"--warmup-steps {run.warmup_steps}): {', '.join(f'{lr:.1e}' for lr in lrs)}")
Image(plot([metrics], os.path.join(run.out_dir, "metrics.png")))"""),
]


def build() -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell(src) if kind == "md"
                else nbformat.v4.new_code_cell(src) for kind, src in CELLS]
    return nb


def execute(nb, timeout=300) -> nbformat.NotebookNode:
    """Runs every cell in notebooks/ (a failing cell raises CellExecutionError naming it)."""
    # iopub_timeout: under load a cell's last printout can arrive seconds after the kernel says the
    # cell is done; nbclient waits 4 s by default and then drops it in silence
    NotebookClient(nb, timeout=timeout, kernel_name="python3", iopub_timeout=60,
                   raise_on_iopub_timeout=True, resources={"metadata": {"path": HERE}}).execute()
    return nb


if __name__ == "__main__":
    nb = execute(build())
    nbformat.write(nb, PATH)
    print(f"wrote {PATH}", file=sys.stderr)
