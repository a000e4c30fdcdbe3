"""
DAPO: Decoupled Clip and Dynamic sAmpling Policy Optimization (Yu et al. 2025, arXiv 2503.14476), in one loop.

DAPO is GRPO (sample G answers per prompt, reward each, use the group-normalised reward as every token's advantage)
with four changes, each a short named function below and a banner in the loop where the paper applies it:
  1. clip-higher            policy_loss(): the upper clip bound eps_high is decoupled and raised     (Sec. 3.1, Eq. 10)
  2. dynamic sampling       keep_groups(): drop groups whose answers are all right or all wrong,
                            and sample more prompts until the batch is full                         (Sec. 3.2, Eq. 11)
  3. token-level loss       policy_loss(): average over all tokens of the batch, not per sequence   (Sec. 3.3, Eq. 12)
  4. overlong shaping       reward.overlong_penalty(): a soft length penalty near the limit          (Sec. 3.4, Eq. 13)
No KL term and no reference model. Entropy is measured and logged, never added to the loss.

    python dapo.py                      # the embedded demo: a tiny model learns the toy task on CPU
    python dapo.py --help               # every flag; the README has the paper's full command line
    python dapo.py --eval-only --model PATH --val-data aime-2024.parquet --eval-samples 32 --eval-top-p 0.7
"""
import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, fields

import torch
from tqdm import tqdm

from data import PromptIterator, encode_prompts, load_rows, load_tokenizer, make_toy_tokenizer, toy_rows
from kernels import logprobs_and_entropy
from model import Qwen2, preset, save_hf_checkpoint
from reward import overlong_penalty, score_response
from sampler import generate


@dataclass
class Config:
    # what to train (the defaults are the embedded CPU demo; the README gives the paper's settings)
    model: str = field(default="", metadata={"help": "Hugging Face Qwen2 directory; empty: the demo's tiny model"})
    train_data: str = field(default="", metadata={"help": "DAPO-Math-17k .parquet/.jsonl; empty: the toy task"})
    val_data: str = field(default="", metadata={"help": "AIME-2024 .parquet/.jsonl; empty: the toy task's test split"})
    out_dir: str = field(default="runs/demo", metadata={"help": "metrics.jsonl and checkpoints go here"})
    resume: bool = field(default=False, metadata={"help": "continue from out_dir's latest checkpoint"})
    eval_only: bool = field(default=False, metadata={"help": "evaluate --model on --val-data and exit"})
    seed: int = field(default=0, metadata={"help": "seeds the model init, the data order and the sampling"})
    device: str = field(default="cuda" if torch.cuda.is_available() else "cpu", metadata={"help": "cpu or cuda"})
    # rollout
    steps: int = field(default=40, metadata={"help": "rollout steps"})
    train_prompts: int = field(default=16, metadata={"help": "prompts per rollout step (paper: 512)"})
    gen_prompts: int = field(default=24, metadata={"help": "prompts per generation batch (paper: 1536 = 3x)"})
    group_size: int = field(default=8, metadata={"help": "responses per prompt, G (paper: 16)"})
    max_gen_batches: int = field(default=4, metadata={"help": "dynamic-sampling cap per step; 0 = no cap"})
    max_prompt_len: int = field(default=64, metadata={"help": "prompt tokens; longer prompts lose their start"})
    max_response_len: int = field(default=40, metadata={"help": "response tokens, L_max (paper: 20480)"})
    overlong_buffer: int = field(default=12, metadata={"help": "soft-penalty zone before L_max, L_cache (4096)"})
    overlong_factor: float = field(default=1.0, metadata={"help": "scale of the overlong penalty"})
    temperature: float = field(default=1.0, metadata={"help": "rollout sampling temperature"})
    top_p: float = field(default=1.0, metadata={"help": "rollout nucleus sampling (1 = off)"})
    top_k: int = field(default=0, metadata={"help": "rollout top-k (0 = off)"})
    # update
    mini_batch_prompts: int = field(default=16, metadata={"help": "prompts per optimizer step (paper: 32)"})
    micro_batch_size: int = field(default=64, metadata={"help": "sequences per forward/backward"})
    lr: float = field(default=2e-4, metadata={"help": "AdamW learning rate (paper: 1e-6)"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay (paper: 0.1)"})
    grad_clip: float = field(default=1.0, metadata={"help": "max grad norm"})
    warmup_steps: int = field(default=3, metadata={"help": "linear lr warm-up, in rollout steps (paper: 10-20)"})
    eps_low: float = field(default=0.2, metadata={"help": "lower clip range: ratio >= 1 - eps_low"})
    eps_high: float = field(default=0.28, metadata={"help": "upper clip range with clip-higher"})
    dual_clip: float = field(default=0.0, metadata={"help": "dual-clip bound c for A < 0 (verl's DAPO: 10); 0 = off"})
    # the four techniques, each switchable for the paper's ablation (all off = naive GRPO)
    clip_higher: bool = field(default=True, metadata={"help": "technique 1: eps_high; off: symmetric eps_low"})
    dynamic_sampling: bool = field(default=True, metadata={"help": "technique 2: keep groups with mixed accuracy"})
    token_level_loss: bool = field(default=True, metadata={"help": "technique 3; off: mean per sequence first"})
    overlong_shaping: bool = field(default=True, metadata={"help": "technique 4: soft overlong punishment"})
    overlong_filtering: bool = field(default=False, metadata={"help": "mask truncated responses out of the loss"})
    # evaluation and checkpoints
    eval_every: int = field(default=10, metadata={"help": "evaluate every N steps (and at step 0); 0 = never"})
    eval_samples: int = field(default=4, metadata={"help": "k of avg@k and pass@k (AIME: 32)"})
    eval_temperature: float = field(default=1.0, metadata={"help": "evaluation temperature (AIME: 1.0)"})
    eval_top_p: float = field(default=1.0, metadata={"help": "evaluation top-p (AIME: 0.7)"})
    eval_prompts: int = field(default=128, metadata={"help": "held-out problems to evaluate (0 = all)"})
    save_every: int = field(default=0, metadata={"help": "checkpoint every N steps (and at the end); 0 = end only"})


def parse_args(argv=None) -> Config:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(Config):
        flag = "--" + f.name.replace("_", "-")
        help_ = f"{f.metadata['help']} (default: {f.default!r})"
        if f.type is bool or f.type == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_)
        else:
            p.add_argument(flag, type=type(f.default), default=f.default, help=help_)
    return Config(**vars(p.parse_args(argv)))


# ----------------------------------------------------------------------------------------------------------------------
# The DAPO techniques, one function each (course assignments point at these names)

def group_advantages(rewards, group_size, eps=1e-6):
    """GRPO's advantage (paper Eq. 9): A_i = (R_i - mean(R_group)) / (std(R_group) + eps), the same for every token
    of response i. rewards (N,) with each group's G responses contiguous -> (N,). std is unbiased (N - 1), as
    torch.std and verl; a group of one sample gets mean 0 and std 1 (verl's convention), so A = R / (1 + eps)."""
    r = rewards.view(-1, group_size)  # (N/G, G)
    if group_size == 1:
        return (r / (1 + eps)).flatten()
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).flatten()  # (N,)


# --- DAPO technique 2: dynamic sampling (paper Sec. 3.2, Eq. 11) ---
def keep_groups(acc, group_size):
    """Which groups carry a learning signal: 0 < #correct < G (Eq. 11's constraint). A group whose answers are all
    right or all wrong has zero advantage everywhere and contributes no gradient, only noise in the batch size.
    acc (N,) bool/float, correctness (not the shaped reward: a group all correct but with different overlong
    penalties is still dropped) -> (N/G,) bool. As verl: population std > 0, or a group of one."""
    a = acc.float().view(-1, group_size)  # (N/G, G)
    return (a.std(1, unbiased=False) > 0) | (group_size == 1)


# --- DAPO techniques 1 and 3: clip-higher and the token-level policy-gradient loss (Sec. 3.1 and 3.3) ---
def policy_loss(logp, old_logp, adv, response_mask, eps_low, eps_high, denom, dual_clip=0.0):
    """The clipped surrogate with decoupled bounds (Eq. 10):
        l_it = max(-A_i r_it, -A_i clip(r_it, 1 - eps_low, 1 + eps_high)),   r_it = pi_theta / pi_old
    summed as sum_it l_it * mask_it / denom. With denom = the number of response tokens in the whole mini-batch
    (counted before it is split into micro-batches and across ranks), this is Eq. 12's token-level mean: every token
    weighs the same, so long responses are not diluted. The naive GRPO loss (mean per sequence, then over sequences)
    is denom = |o_i| * n_sequences, (B, 1). logp, old_logp, response_mask (B, T); adv (B,).
    dual_clip > 1 caps the loss of a negative-advantage token at -A * c (verl's dual clip) when the ratio explodes.
    Returns the loss and sums over masked tokens of the statistics the loop logs."""
    mask = response_mask.float()
    adv = adv[:, None]  # (B, 1): one advantage for every token of a response
    ratio = torch.exp(logp - old_logp)  # (B, T)
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    loss_tok = torch.maximum(-adv * ratio, -adv * clipped)  # (B, T): the pessimistic (larger) of the two losses
    if dual_clip > 1:
        loss_tok = torch.where(adv < 0, torch.minimum(loss_tok, -adv * dual_clip), loss_tok)
    loss = (loss_tok * mask / denom).sum()
    with torch.no_grad():
        stats = {  # sums over tokens; divided by the token count when logged
            "actor/pg_loss": (loss_tok * mask).sum(),
            "actor/pg_clipfrac_high": (((adv > 0) & (ratio > 1 + eps_high)) * mask).sum(),
            "actor/pg_clipfrac_low": (((adv < 0) & (ratio < 1 - eps_low)) * mask).sum(),
            "actor/ppo_kl": ((old_logp - logp) * mask).sum(),  # a first-order estimate of KL(pi_old || pi_theta)
        }
    return loss, stats


# ----------------------------------------------------------------------------------------------------------------------
# Rollout and scoring

def pack(prompts, responses, pad_id, device):
    """Lists of token ids -> one batch: prompts left-padded, responses right-padded, so every response starts at
    column P. Returns input_ids, positions, attention_mask (B, P + R) and P. Positions count real tokens only, so
    padding never shifts RoPE."""
    P, R = max(map(len, prompts)), max(map(len, responses))
    ids = torch.full((len(prompts), P + R), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), P + R, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, P - len(p):P], ids[i, P:P + len(r)] = torch.tensor(p), torch.tensor(r)
        mask[i, P - len(p):P + len(r)] = True
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), positions.to(device), mask.to(device), P


def response_logprobs(model, prompts, responses, pad_id, temperature):
    """log pi(o_t | q, o_<t) and the entropy of that distribution for every response token: (B, R) each, fp32.
    The output layer runs inside the model's forward (so FSDP has it gathered) and only on response positions, and
    the fused kernel never materialises fp32 softmax copies of the (B, R, V) logits."""
    ids, positions, mask, P = pack(prompts, responses, pad_id, next(model.parameters()).device)
    targets = ids[:, P:]  # (B, R): the token at column P + t is predicted by the hidden state at P + t - 1

    def head(hidden, weight):  # hidden (B, P + R, C)
        logits = hidden[:, P - 1:-1] @ weight.T  # (B, R, V)
        return logprobs_and_entropy(logits, targets, temperature)

    logp, entropy = model(ids, positions=positions, attention_mask=mask, head=head)
    return logp, entropy, mask[:, P:]  # (B, R) x 3


@torch.no_grad()
def rollout(model, rows, tok, cfg, n_samples, temperature, top_p, top_k, generator):
    """Sample n_samples responses to each prompt and score them. Returns one group (a list of dicts) per prompt."""
    prompts, _ = encode_prompts(rows, tok, cfg.max_prompt_len)
    out = generate(model, [p for p in prompts for _ in range(n_samples)], cfg.max_response_len, temperature=temperature,
                   top_p=top_p, top_k=top_k, eos_token_ids=tok.eos_token_ids, pad_token_id=tok.pad_token_id,
                   generator=generator)
    groups = []
    for g, row in enumerate(rows):
        group = []
        for i in range(g * n_samples, (g + 1) * n_samples):
            response = out.response_ids[i, :out.lengths[i]].tolist()
            scored = score_response(row["data_source"], tok.decode(response), row["reward_model"]["ground_truth"])
            group.append(dict(prompt=prompts[g], response=response, score=scored["score"], acc=bool(scored["acc"]),
                              truncated=bool(out.truncated[i])))
        groups.append(group)
    return groups


def evaluate(model, rows, tok, cfg, generator):
    """avg@k (mean accuracy over k samples per problem: the paper's avg@32 on AIME) and pass@k (any of the k right)."""
    acc = []
    for i in range(0, len(rows), max(1, 256 // cfg.eval_samples)):
        for group in rollout(model, rows[i:i + max(1, 256 // cfg.eval_samples)], tok, cfg, cfg.eval_samples,
                             cfg.eval_temperature, cfg.eval_top_p, 0, generator):
            acc.append([s["acc"] for s in group])
    acc = torch.tensor(acc, dtype=torch.float)  # (problems, k)
    return {"val/acc": acc.mean().item(), f"val/pass@{cfg.eval_samples}": acc.amax(1).mean().item()}


# ----------------------------------------------------------------------------------------------------------------------
# Checkpoints: data, not code. Weights in safetensors (a Hugging Face directory any Qwen2 loader reads), the trainer's
# tensors through torch.load(weights_only=True), everything else JSON. Written to a temporary directory and renamed.

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json")


def save_checkpoint(cfg, step, model, tok_dir, opt, prompt_iter, generator):
    final = os.path.join(cfg.out_dir, "checkpoints", f"step_{step:06d}")
    tmp = final + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    save_hf_checkpoint(model.state_dict(), model.config, os.path.join(tmp, "model"))
    for name in TOKENIZER_FILES:  # the model directory is self-contained: --eval-only --model can point at it
        if os.path.isfile(os.path.join(tok_dir, name)):
            with open(os.path.join(tok_dir, name), "rb") as src, open(os.path.join(tmp, "model", name), "wb") as dst:
                dst.write(src.read())
    torch.save({"optimizer": opt.state_dict(), "generator": generator.get_state(),
                "torch_rng": torch.get_rng_state()}, os.path.join(tmp, "trainer.pt"))
    with open(os.path.join(tmp, "trainer.json"), "w") as f:
        json.dump({"step": step, "data": prompt_iter.state_dict(), "config": asdict(cfg)}, f, indent=1)
    if os.path.isdir(final):
        os.rename(final, final + ".old")
    os.replace(tmp, final)
    _write_atomic(os.path.join(cfg.out_dir, "checkpoints", "latest"), os.path.basename(final))
    if os.path.isdir(final + ".old"):
        import shutil
        shutil.rmtree(final + ".old")
    return final


def _write_atomic(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def latest_checkpoint(out_dir):
    pointer = os.path.join(out_dir, "checkpoints", "latest")
    if not os.path.isfile(pointer):
        raise FileNotFoundError(f"--resume: no checkpoint under {out_dir} ({pointer} does not exist)")
    with open(pointer) as f:
        return os.path.join(out_dir, "checkpoints", f.read().strip())


def load_trainer_state(ckpt, opt, prompt_iter, generator):
    state = torch.load(os.path.join(ckpt, "trainer.pt"), weights_only=True)  # tensors and numbers only: no code runs
    opt.load_state_dict(state["optimizer"])
    generator.set_state(state["generator"])
    torch.set_rng_state(state["torch_rng"])
    with open(os.path.join(ckpt, "trainer.json")) as f:
        meta = json.load(f)
    prompt_iter.load_state_dict(meta["data"])
    return meta["step"]


# ----------------------------------------------------------------------------------------------------------------------
# The training loop (paper Algorithm 1)

def setup(cfg):
    """The model and tokenizer (a Qwen2 directory, a checkpoint to resume, or the demo's base model) and the data."""
    torch.manual_seed(cfg.seed)
    os.makedirs(cfg.out_dir, exist_ok=True)
    resume_dir = latest_checkpoint(cfg.out_dir) if cfg.resume else None
    if cfg.model or resume_dir:
        model_dir = os.path.join(resume_dir, "model") if resume_dir else cfg.model
        tok_dir = model_dir
        model = Qwen2.from_pretrained(model_dir, dtype=torch.float32, device=cfg.device)
    else:  # the embedded demo: a toy tokenizer and a tiny model given a brief supervised warm-up (see warmup.py)
        from warmup import demo_base_model
        tok_dir = os.path.join(cfg.out_dir, "tokenizer")
        make_toy_tokenizer(tok_dir)
        model = demo_base_model(load_tokenizer(tok_dir), cfg.device, seed=cfg.seed)
    tok = load_tokenizer(tok_dir)
    train_rows = load_rows(cfg.train_data) if cfg.train_data else toy_rows(20000, seed=cfg.seed, split="train")
    val_rows = load_rows(cfg.val_data) if cfg.val_data else toy_rows(1000, seed=cfg.seed, split="test")
    if cfg.eval_prompts:
        val_rows = val_rows[:cfg.eval_prompts]
    return model, tok, tok_dir, train_rows, val_rows, resume_dir


def main(cfg: Config):
    model, tok, tok_dir, train_rows, val_rows, resume_dir = setup(cfg)
    G = cfg.group_size
    eps_high = cfg.eps_high if cfg.clip_higher else cfg.eps_low  # technique 1 off: the symmetric clip of PPO/GRPO
    new_eval_generator = lambda: torch.Generator(cfg.device).manual_seed(cfg.seed + 1)  # same eval draws every time
    if cfg.eval_only:
        print(json.dumps(evaluate(model, val_rows, tok, cfg, new_eval_generator())))
        return
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.999), weight_decay=cfg.weight_decay)
    prompt_iter = PromptIterator(train_rows, cfg.gen_prompts if cfg.dynamic_sampling else cfg.train_prompts, cfg.seed)
    generator = torch.Generator(cfg.device).manual_seed(cfg.seed)
    start = load_trainer_state(resume_dir, opt, prompt_iter, generator) if resume_dir else 0
    metrics_file = open(os.path.join(cfg.out_dir, "metrics.jsonl"), "a")
    log = lambda m: (metrics_file.write(json.dumps(m) + "\n"), metrics_file.flush())
    first_val = last_val = None
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="dapo", dynamic_ncols=True)
    for step in bar:
        if cfg.eval_every and step % cfg.eval_every == 0:
            model.eval()
            last_val = evaluate(model, val_rows, tok, cfg, new_eval_generator())
            first_val = first_val or last_val
            log({"step": step, **last_val})
        t0 = time.time()
        for group in opt.param_groups:  # linear warm-up over the first rollout steps, then constant (paper Sec. 4.1)
            group["lr"] = cfg.lr * min(1.0, (step + 1) / max(1, cfg.warmup_steps))

        # --- Rollout (Algorithm 1, lines 3-7): pi_old = the current policy samples G responses per prompt ---
        kept, seen, n_gen = [], [], 0
        while len(kept) < cfg.train_prompts:
            if cfg.max_gen_batches and n_gen == cfg.max_gen_batches:
                # verl raises here; small models hit this wall, so train on what was kept, and say so
                tqdm.write(f"step {step + 1}: dynamic sampling stopped at max_gen_batches={cfg.max_gen_batches} with "
                           f"{len(kept)}/{cfg.train_prompts} informative groups; training on those")
                break
            model.eval()
            groups = rollout(model, prompt_iter.next_batch(), tok, cfg, G, cfg.temperature, cfg.top_p, cfg.top_k,
                             generator)
            n_gen += 1
            # --- DAPO technique 4: overlong reward shaping (paper Sec. 3.4, Eq. 13) ---
            for s in (s for g in groups for s in g):
                s["reward"] = s["score"] + (overlong_penalty(len(s["response"]), cfg.max_response_len,
                                                             cfg.overlong_buffer, cfg.overlong_factor)
                                            if cfg.overlong_shaping else 0.0)
            seen += groups
            # --- DAPO technique 2: dynamic sampling (paper Sec. 3.2): keep groups whose accuracy varies ---
            acc = torch.tensor([[s["acc"] for s in g] for g in groups])  # (prompts, G)
            keep = keep_groups(acc.flatten(), G) if cfg.dynamic_sampling else torch.ones(len(groups), dtype=bool)
            kept += [g for g, k in zip(groups, keep) if k]
        kept = kept[:cfg.train_prompts]  # exactly the training batch, in whole groups; the surplus is discarded
        samples = [s for g in kept for s in g]
        t_gen = time.time() - t0

        m = {"step": step + 1, **rollout_metrics(seen, kept, n_gen, cfg)}
        if samples:
            # --- Group advantages (paper Eq. 9), one per response, broadcast to its tokens ---
            adv = group_advantages(torch.tensor([s["reward"] for s in samples]), G)  # (N,)
            for s, a in zip(samples, adv.tolist()):
                s["adv"] = a
            m.update(update_policy(model, opt, samples, tok, cfg, eps_high))
        m.update({"actor/lr": opt.param_groups[0]["lr"], "timing/gen_s": t_gen, "timing/train_s": time.time() - t0 - t_gen})
        m["perf/tokens_per_s"] = m.pop("train/tokens", 0) / max(time.time() - t0, 1e-9)
        log(m)
        bar.set_postfix({"reward": f"{m['critic/rewards/mean']:.2f}", "acc": f"{m['acc']:.2f}",
                         "entropy": f"{m.get('actor/entropy', float('nan')):.2f}",
                         "len": f"{m['response_length/mean']:.1f}"})
        if (cfg.save_every and (step + 1) % cfg.save_every == 0) or step + 1 == cfg.steps:
            save_checkpoint(cfg, step + 1, model, tok_dir, opt, prompt_iter, generator)
    if cfg.eval_every and start < cfg.steps:
        model.eval()
        last_val = evaluate(model, val_rows, tok, cfg, new_eval_generator())
        log({"step": cfg.steps, **last_val})
        if first_val:
            print(f"val/acc (avg@{cfg.eval_samples}): {first_val['val/acc']:.3f} at step {start} -> "
                  f"{last_val['val/acc']:.3f} at step {cfg.steps}; "
                  f"pass@{cfg.eval_samples}: {first_val[f'val/pass@{cfg.eval_samples}']:.3f} -> "
                  f"{last_val[f'val/pass@{cfg.eval_samples}']:.3f}")
    metrics_file.close()
    return last_val


def rollout_metrics(seen, kept, n_gen, cfg):
    """What the policy did this step, over every response generated (before the dynamic-sampling filter)."""
    flat = [s for g in seen for s in g]
    acc = torch.tensor([[s["acc"] for s in g] for g in seen], dtype=torch.float)  # (prompts, G)
    lengths = torch.tensor([len(s["response"]) for s in flat], dtype=torch.float)
    return {
        "critic/score/mean": sum(s["score"] for s in flat) / len(flat),
        "critic/rewards/mean": sum(s["reward"] for s in flat) / len(flat),
        "acc": acc.mean().item(),
        "response_length/mean": lengths.mean().item(),
        "response_length/max": lengths.max().item(),
        "response_length/clip_ratio": sum(s["truncated"] for s in flat) / len(flat),
        "train/num_gen_batches": n_gen,
        "train/groups_kept": len(kept),
        "train/groups_filtered": len(seen) - len(kept),
        "train/frac_all_correct": (acc.min(1).values == 1).float().mean().item(),
        "train/frac_all_wrong": (acc.max(1).values == 0).float().mean().item(),
    }


def update_policy(model, opt, samples, tok, cfg, eps_high):
    """Algorithm 1, lines 10-11: one epoch over the batch in mini-batches (one optimizer step each) of micro-batches
    (gradient accumulation). Returns the step's training metrics."""
    model.train()
    T, pad = cfg.temperature, tok.pad_token_id
    mini = cfg.mini_batch_prompts * cfg.group_size  # sequences per optimizer step
    micro_batches = lambda batch: [batch[i:i + cfg.micro_batch_size] for i in range(0, len(batch), cfg.micro_batch_size)]
    # pi_old (Algorithm 1, line 4): with several optimizer steps per rollout the policy moves between them, so the
    # log-probs of the policy that sampled the batch are recomputed now, by the training model (the sampler's own
    # differ in the last bits: its cached path sums in another order). With one step, pi_old = pi_theta.detach().
    if len(samples) > mini:
        with torch.no_grad():
            for mb in micro_batches(samples):
                logp, _, _ = response_logprobs(model, [s["prompt"] for s in mb], [s["response"] for s in mb], pad, T)
                for s, lp in zip(mb, logp):
                    s["old_logp"] = lp[:len(s["response"])]
    sums, n_tokens_total, n_updates, n_skipped, grad_norms, trained = {}, 0, 0, 0, [], 0
    for i in range(0, len(samples), mini):
        batch = samples[i:i + mini]
        in_loss = [not (cfg.overlong_filtering and s["truncated"]) for s in batch]  # overlong filtering (ablation)
        # --- DAPO technique 3: the token-level loss's denominator, counted over the whole mini-batch up front, so
        # the gradient does not depend on how the mini-batch is split into micro-batches (or ranks) ---
        n_tokens = sum(len(s["response"]) for s, keep in zip(batch, in_loss) if keep)
        n_seqs = sum(in_loss)
        if n_tokens == 0:
            continue
        for mb in micro_batches(batch):
            logp, entropy, mask = response_logprobs(model, [s["prompt"] for s in mb], [s["response"] for s in mb],
                                                    pad, T)  # (B, R) x 3
            mask = mask & torch.tensor([not (cfg.overlong_filtering and s["truncated"]) for s in mb],
                                       device=mask.device)[:, None]
            old_logp = torch.zeros_like(logp)
            for j, s in enumerate(mb):
                old_logp[j, :len(s["response"])] = s["old_logp"] if "old_logp" in s else logp[j, :len(s["response"])]
            adv = torch.tensor([s["adv"] for s in mb], device=logp.device)  # (B,)
            # the naive GRPO alternative: each sequence's mean, then the mean over sequences (technique 3 off)
            denom = n_tokens if cfg.token_level_loss else mask.sum(-1, keepdim=True).clamp(min=1) * n_seqs
            # --- DAPO technique 1: clip-higher, inside the clipped surrogate (paper Sec. 3.1, Eq. 10) ---
            loss, stats = policy_loss(logp, old_logp.detach(), adv, mask, cfg.eps_low, eps_high, denom, cfg.dual_clip)
            loss.backward()
            stats["actor/entropy"] = (entropy.detach() * mask).sum()
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v.item()
            trained += sum(len(s["prompt"]) + len(s["response"]) for s in mb)
        n_tokens_total += n_tokens
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        if torch.isfinite(grad_norm):
            opt.step()
            n_updates += 1
        else:  # a NaN/inf anywhere in the gradient: skip this update (it never reaches the weights or a checkpoint)
            n_skipped += 1
            tqdm.write(f"non-finite gradient norm ({grad_norm.item()}): update skipped")
        opt.zero_grad(set_to_none=True)
        grad_norms.append(grad_norm.item())
    out = {k: v / max(n_tokens_total, 1) for k, v in sums.items()}
    out["actor/pg_clipfrac"] = out.get("actor/pg_clipfrac_high", 0.0) + out.get("actor/pg_clipfrac_low", 0.0)
    finite = [g for g in grad_norms if math.isfinite(g)]
    out.update({"actor/grad_norm": sum(finite) / len(finite) if finite else float("nan"),
                "train/updates": n_updates, "train/skipped_updates": n_skipped, "train/tokens": trained})
    return out


if __name__ == "__main__":
    main(parse_args())
