"""Writes notebooks/dapo_step.ipynb from the cells below and executes it (nbclient), so that the
committed notebook carries its outputs and reads on GitHub:

    .venv/bin/python notebooks/build.py

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
function (`dapo.py`, `reward.py`, `toy.py`) and shows a table or a picture, in the order of
one step: the toy task and its base model, G responses to one prompt, the group advantage
(Eq. 9), the dynamic-sampling filter (Eq. 11), clip-higher (Eq. 10), the token-level loss
(Eq. 12), the soft overlong punishment (Eq. 13), one policy update, and a short run's curves.

On a laptop CPU it runs in about a minute once the demo's base model is cached in
`runs/demo-base` (as `python dapo.py` leaves it); on a fresh clone the first cell that needs
the model trains it once (the demo's warm-up, a minute or two on one core)."""),
    ("code", """# On Colab: fetch the project (DAPO_REPO: its git URL) and its requirements
import os, subprocess, sys
if "google.colab" in sys.modules and not os.path.exists("dapo.py"):
    subprocess.run(["git", "clone", "--depth", "1", os.environ["DAPO_REPO"], "dapo"], check=True)
    os.chdir("dapo")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-r", "requirements.txt",
                    "matplotlib"], check=True)
root = os.path.abspath("..") if os.path.basename(os.getcwd()) == "notebooks" else os.getcwd()
sys.path.insert(0, root)
os.chdir(root)  # the demo's paths (runs/demo-base, runs/...) are relative to the project
os.environ.setdefault("OMP_NUM_THREADS", "1")  # a tiny model: one thread is fastest
from dataclasses import replace
import matplotlib.pyplot as plt
import torch
from config import parse_args
from data import load_tokenizer
from dapo import (group_advantages, groups_to_train, keep_groups, policy_loss, rollout,
                  shape_rewards, update_policy)
from reward import overlong_penalty
from toy import demo_policy, toy_rows"""),
    ("md", """## The toy task and what the base model does

Sums of 2-3 digits (`toy.py`), answered as `Answer: N` and scored by the math_dapo verifier:
+1 right, -1 wrong. The base model (a tiny Qwen2, warmed up on noisy responses) can work a
sum out but guesses half the time, and now and then rambles (`Let me check.`) first. Here: its
answers to six held-out problems, one sample each at temperature 1."""),
    ("code", """cfg = parse_args(["--out-dir", "runs/notebook"])  # the demo's settings (config.py)
tok_dir, model = demo_policy(cfg.out_dir, cfg.device, cfg.seed)  # cached in runs/demo-base
tok = load_tokenizer(tok_dir)
generator = torch.Generator().manual_seed(0)
def sample(rows, group_size):
    return rollout(model, rows, tok, cfg, group_size=group_size, temperature=cfg.temperature,
                   top_p=cfg.top_p, top_k=cfg.top_k, generator=generator)
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

Algorithm 1, lines 3-5: the policy samples G = 8 responses to one training prompt, the
verifier scores each (`score`), and Eq. 13's length penalty is added (`reward`)."""),
    ("code", """G = cfg.group_size
prompt = toy_rows(1, seed=0)
group = sample(prompt, group_size=G)
group = replace(group, reward=shape_rewards(group.response_lengths, group.score, cfg))
print(f"prompt {prompt[0]['prompt'][0]['content']} (sum "
      f"{prompt[0]['reward_model']['ground_truth']})")
print(f"{'#':<2} {'tokens':>6} {'score':>6} {'reward':>7}  response")
for i, text in enumerate(responses(group)):
    print(f"{i:<2} {group.response_lengths[i]:>6} {group.score[i]:>+6.0f} "
          f"{group.reward[i]:>+7.3f}  {text}")"""),
    ("md", """## Eq. 9: the group advantage

Four prompts, G = 4 responses each, reward +1 (right) or -1 (wrong). Each response's advantage
is its reward minus its group's mean, over the group's (unbiased) standard deviation. A group
all right or all wrong has advantage 0 everywhere: it teaches nothing."""),
    ("code", """G = 4
rewards = torch.tensor([1., -1, -1, -1,   1, 1, -1, -1,   1, 1, 1, 1,   -1, -1, -1, -1])
adv = group_advantages(rewards, G)
for g in range(len(rewards) // G):
    r, a = rewards[g * G:(g + 1) * G], adv[g * G:(g + 1) * G]
    print(f"group {g}: rewards {r.tolist()}  advantages {[round(x, 3) for x in a.tolist()]}")"""),
    ("md", """The same on the sampled group above: the right responses get a positive advantage, the
wrong ones a negative one, and the advantages sum to zero."""),
    ("code", """G = cfg.group_size  # 8 (the made-up example above used 4)
group_adv = group_advantages(group.reward, G)
print(f"{'#':<2} {'right':<5} {'reward':>7} {'advantage':>9}")
for i in range(G):
    print(f"{i:<2} {str(bool(group.acc[i])):<5} {group.reward[i]:>+7.3f} {group_adv[i]:>+9.3f}")
print(f"sum of the advantages: {group_adv.sum():+.2e}")"""),
    ("md", """## Eq. 11: dynamic sampling keeps the groups with signal

`keep_groups` looks at correctness (not at the shaped reward): a group survives iff
0 < #right < G. DAPO samples more groups until the batch is full of survivors."""),
    ("code", """acc = rewards > 0
kept = keep_groups(acc, G)
for g, k in enumerate(kept.tolist()):
    n_right = int(acc[g * G:(g + 1) * G].sum())
    print(f"group {g}: {n_right}/{G} right -> {'kept' if k else 'dropped (no signal)'}")"""),
    ("md", """On one real generation batch (`--gen-prompts` 48 prompts, G responses each): how
many of each group's responses are right, and which groups survive. The dropped ones are all
wrong (too hard for the model now) or all right (already learned)."""),
    ("code", """G = cfg.group_size
gen_batch = sample(toy_rows(cfg.gen_prompts, seed=1), group_size=G)
gen_batch = replace(gen_batch, reward=shape_rewards(gen_batch.response_lengths,
                                                    gen_batch.score, cfg))
kept = keep_groups(gen_batch.acc, G)  # (groups,) bool
n_right = gen_batch.acc.view(-1, G).sum(1)  # (groups,)
plt.figure(figsize=(6, 3))
plt.hist([n_right[kept].tolist(), n_right[~kept].tolist()], bins=range(G + 2), align="left",
         stacked=True, label=["kept", "dropped"])
plt.xlabel(f"right responses in the group (of G = {G})"); plt.ylabel("groups")
plt.legend(); plt.tight_layout(); plt.show()
print(f"{int(kept.sum())} of {len(kept)} groups kept; dropped: {int((n_right == 0).sum())} "
      f"all wrong, {int((n_right == G).sum())} all right")"""),
    ("md", """## Eq. 10: clip-higher

One token, ratio r = pi_theta / pi_old. The loss is `policy_loss` with eps_low 0.2 and
eps_high 0.28 (DAPO) against the symmetric 0.2 (PPO/GRPO); its gradient with respect to the
log-prob comes from autograd. Where the gradient is zero (shaded) the token no longer moves:
with A > 0 a rare token may rise up to 1.28 times its old probability instead of 1.2."""),
    ("code", """def surrogate(ratio, a, eps_high):
    \"\"\"Each token's objective -l (one per ratio), its gradient w.r.t. its log-prob.\"\"\"
    logp = torch.log(ratio).clone().requires_grad_(True)  # (K,)
    k = len(ratio)
    args = (torch.zeros(k, 1), torch.full((k,), a), torch.ones(k, 1), 0.2, eps_high)
    policy_loss(logp[:, None], *args, denom=1.0).loss.backward()  # a sum: each token's gradient
    objective = [-policy_loss(logp[i:i + 1, None].detach(), args[0][:1], args[1][:1],
                              args[2][:1], 0.2, eps_high, denom=1.0).loss.item()
                 for i in range(k)]
    return objective, logp.grad

ratio = torch.linspace(0.5, 1.6, 221)
fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
for ax, a in zip(axes, (1.0, -1.0)):
    for eps_high, style in ((0.2, "--"), (0.28, "-")):
        objective, grad = surrogate(ratio, a, eps_high)
        line, = ax.plot(ratio, objective, style, label=f"eps_high {eps_high}")
        ax.fill_between(ratio, 0, 1, where=(grad == 0).tolist(), alpha=0.08,
                        color=line.get_color(), transform=ax.get_xaxis_transform())
    ax.set(title=f"A = {a:+} (shaded: zero gradient)", xlabel="ratio r",
           ylabel="objective -l = min(A r, A clip(r))")
    ax.legend()
plt.tight_layout(); plt.show()
for a in (1.0, -1.0):
    for eps_high in (0.2, 0.28):
        _, grad = surrogate(ratio, a, eps_high)
        moving = ratio[grad != 0]
        print(f"A = {a:+}, eps_high {eps_high}: gradient nonzero for r in "
              f"[{moving.min():.3f}, {moving.max():.3f}]")"""),
    ("md", """## Eq. 12: the token-level loss

A short response (4 tokens) and a long one (16), both with advantage 1. Each token's weight is
the gradient of the loss with respect to its log-prob at r = 1. Eq. 12 divides by the
mini-batch's token count (every token weighs the same); GRPO's per-sample mean divides each
response by its own length, so each long-response token weighs 4 times less."""),
    ("code", """lengths = [4, 16]
mask = torch.zeros(2, 16)
for i, n in enumerate(lengths):
    mask[i, :n] = 1
def token_weights(denom):
    logp = torch.zeros(2, 16, requires_grad=True)
    policy_loss(logp, torch.zeros(2, 16), torch.ones(2), mask, 0.2, 0.28, denom).loss.backward()
    return -logp.grad  # (2, 16)
dapo_w = token_weights(mask.sum())                                      # Eq. 12
grpo_w = token_weights(mask.sum(1, keepdim=True) * len(lengths))        # per-sample mean
print("response  tokens  weight/token Eq.12  GRPO    total Eq.12  GRPO")
for i, n in enumerate(lengths):
    print(f"{['short', 'long'][i]:<9} {n:>6}  {dapo_w[i, 0]:>17.4f} {grpo_w[i, 0]:>6.4f}"
          f"  {dapo_w[i].sum():>11.3f} {grpo_w[i].sum():>5.3f}")"""),
    ("md", """## Eq. 13: the soft overlong punishment

No penalty up to L_max - L_cache, then a linear ramp down to -1 at L_max, and -1 beyond
(the demo's settings: L_max 96, L_cache 16)."""),
    ("code", """max_len, buffer_len = 96, 16
lengths = list(range(40, 111))
plt.figure(figsize=(5, 3))
plt.plot(lengths, [overlong_penalty(n, max_len, buffer_len) for n in lengths])
plt.axvline(max_len - buffer_len, ls=":"); plt.axvline(max_len, ls=":")
plt.xlabel("response length (tokens)"); plt.ylabel("penalty added to the reward")
plt.tight_layout(); plt.show()"""),
    ("md", """## One policy update, and what it logged

Algorithm 1, lines 9-11, on the groups kept above: the group advantages (Eq. 9), then
`update_policy`, one optimizer step per mini-batch of `--mini-batch-prompts` groups, with
clip-higher and the token-level loss. The row it returns goes into the run's metrics.jsonl
(docs/metrics.md says what each one means)."""),
    ("code", """n_take = groups_to_train(int(kept.sum()), cfg)
train_batch = gen_batch.groups(kept.nonzero().flatten()[:n_take].tolist())
train_batch = replace(train_batch, adv=group_advantages(train_batch.reward, G))
opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
logged = update_policy(model, opt, train_batch, cfg, cfg.eps_high)
print(f"trained on {n_take} groups ({len(train_batch)} responses)")
for key, value in logged.items():
    print(f"{key:<24} {value:.4g}")"""),
    ("md", """## A short run and its curves

`dapo.main` on the demo for 10 steps (the full demo, `python dapo.py`, runs 40), then
`experiments/plot.py`'s figure of its metrics.jsonl. With this few steps the curves are
noisy: the README's demo shows the trend."""),
    ("code", """import dapo
from IPython.display import Image
from experiments.plot import plot
import contextlib, io
run = parse_args(["--out-dir", "runs/notebook", "--overwrite", "--steps", "10",
                  "--eval-every", "5", "--eval-prompts", "64", "--warmup-steps", "1"])
with contextlib.redirect_stderr(io.StringIO()):  # the progress bar: a stderr line per step here
    dapo.main(run)
Image(plot([os.path.join(run.out_dir, "metrics.jsonl")],
           os.path.join(run.out_dir, "metrics.png")))"""),
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
