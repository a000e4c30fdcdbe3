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
import contextlib
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field, fields

import torch
from tqdm import tqdm

import checkpoint
import distributed
from data import PromptIterator, encode_prompts, load_rows, load_tokenizer
from toy import demo_base_model, make_toy_tokenizer, toy_rows
from kernels import logprobs_and_entropy
from model import Qwen2
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
    train_prompts: int = field(default=32, metadata={"help": "prompts per rollout step (paper: 512)"})
    gen_prompts: int = field(default=48, metadata={"help": "prompts per generation batch (paper: 1536 = 3x)"})
    group_size: int = field(default=8, metadata={"help": "responses per prompt, G (paper: 16)"})
    max_gen_batches: int = field(default=4, metadata={"help": "dynamic-sampling cap per step; 0 = no cap"})
    max_prompt_len: int = field(default=64, metadata={"help": "prompt tokens; longer prompts lose their start"})
    max_response_len: int = field(default=40, metadata={"help": "response tokens, L_max (paper: 20480)"})
    overlong_buffer: int = field(default=16, metadata={"help": "soft-penalty zone before L_max, L_cache (4096)"})
    overlong_factor: float = field(default=1.0, metadata={"help": "scale of the overlong penalty"})
    temperature: float = field(default=1.0, metadata={"help": "rollout sampling temperature"})
    top_p: float = field(default=1.0, metadata={"help": "rollout nucleus sampling (1 = off)"})
    top_k: int = field(default=0, metadata={"help": "rollout top-k (0 = off)"})
    rollout_batch_size: int = field(default=512, metadata={"help": "sequences generated at once per process: bounds "
                                                                    "the KV cache's memory (0 = all)"})
    # update
    mini_batch_prompts: int = field(default=8, metadata={"help": "prompts per optimizer step (paper: 32)"})
    micro_batch_size: int = field(default=64, metadata={"help": "sequences per forward/backward"})
    lr: float = field(default=3e-4, metadata={"help": "AdamW learning rate (paper: 1e-6)"})
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
    activation_checkpointing: bool = field(default=False, metadata={"help": "recompute block activations in the "
                                                                              "backward: less memory, ~30% more time"})


def parse_args(argv=None) -> Config:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(Config):
        flag, help_ = "--" + f.name.replace("_", "-"), f.metadata["help"].replace("%", "%%")
        is_bool = isinstance(f.default, bool)
        kind = dict(action=argparse.BooleanOptionalAction) if is_bool else dict(type=type(f.default))
        p.add_argument(flag, **kind, default=f.default, help=help_ + " (default: %(default)r)")  # bool: --x / --no-x
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
        logp, entropy = logprobs_and_entropy(logits, targets, temperature)
        return logp.clone(), entropy.clone()  # not views: FSDP2 warns that in-place ops on a view lose its hooks

    logp, entropy = model(ids, positions=positions, attention_mask=mask, head=head)
    return logp, entropy, mask[:, P:]  # (B, R) x 3


@torch.no_grad()
def rollout(model, rows, tok, cfg, n_samples, temperature, top_p, top_k, generator):
    """Sample n_samples responses to each prompt and score them. Returns one group (a list of dicts) per prompt.
    At most cfg.rollout_batch_size sequences go through generate() at once: the KV cache is preallocated for the
    whole batch at full length, so this is what bounds the rollout's memory."""
    prompts, _ = encode_prompts(rows, tok, cfg.max_prompt_len)
    per_call = max(1, cfg.rollout_batch_size // n_samples) if cfg.rollout_batch_size else len(prompts)
    groups = []
    for start in range(0, len(prompts), per_call):
        part = prompts[start:start + per_call]
        out = generate(model, [p for p in part for _ in range(n_samples)], cfg.max_response_len,
                       temperature=temperature, top_p=top_p, top_k=top_k, eos_token_ids=tok.eos_token_ids,
                       pad_token_id=tok.pad_token_id, generator=generator)
        for g, (prompt, row) in enumerate(zip(part, rows[start:start + per_call])):
            group = []
            for i in range(g * n_samples, (g + 1) * n_samples):
                response = out.response_ids[i, :out.lengths[i]].tolist()
                scored = score_response(row["data_source"], tok.decode(response), row["reward_model"]["ground_truth"])
                group.append(dict(prompt=prompt, response=response, score=scored["score"], acc=bool(scored["acc"]),
                                  truncated=bool(out.truncated[i])))
            groups.append(group)
    return groups


def evaluate(model, rows, tok, cfg, generator):
    """avg@k (mean accuracy over k samples per problem: the paper's avg@32 on AIME) and pass@k (any of the k right).
    Under torch.distributed each rank takes every world_size-th problem and the counts are summed."""
    mine, chunk = rows[distributed.rank()::distributed.world_size()], 64  # problems per rollout() call
    right = any_right = 0.0
    calls = math.ceil(math.ceil(len(rows) / distributed.world_size()) / chunk)  # the same on every rank (lockstep)
    for c in range(calls):
        part = mine[c * chunk:(c + 1) * chunk]
        with distributed.gathered(model):  # a rank with no problems left decodes one anyway and ignores it
            groups = rollout(model, part or rows[:1], tok, cfg, cfg.eval_samples, cfg.eval_temperature,
                             cfg.eval_top_p, 0, generator)
        if part:
            right += sum(s["acc"] for g in groups for s in g)
            any_right += sum(any(s["acc"] for s in g) for g in groups)
    right, any_right = distributed.all_reduce([right, any_right], device=cfg.device)
    return {"val/acc": right / (len(rows) * cfg.eval_samples), f"val/pass@{cfg.eval_samples}": any_right / len(rows)}


# ----------------------------------------------------------------------------------------------------------------------
# The training loop (paper Algorithm 1)

def setup(cfg):
    """The model and tokenizer (a Qwen2 directory, a checkpoint to resume, or the demo's base model) and the data."""
    torch.manual_seed(cfg.seed)
    os.makedirs(cfg.out_dir, exist_ok=True)
    resume_dir = checkpoint.latest(cfg.out_dir) if cfg.resume else None
    if cfg.model or resume_dir:
        tok_dir = os.path.join(resume_dir, "model") if resume_dir else cfg.model
        model = Qwen2.from_pretrained(tok_dir, dtype=torch.float32, device=cfg.device)  # fp32 master weights
    else:  # the embedded demo: a toy tokenizer and a tiny model given a brief supervised warm-up (see toy.py)
        tok_dir = os.path.join(cfg.out_dir, "tokenizer")
        if distributed.rank() == 0:
            make_toy_tokenizer(tok_dir)
            demo_base_model(load_tokenizer(tok_dir), cfg.device, seed=cfg.seed)  # trains once, then cached
        distributed.barrier()
        model = demo_base_model(load_tokenizer(tok_dir), cfg.device, seed=cfg.seed)
    model.activation_checkpointing = cfg.activation_checkpointing
    if distributed.world_size() > 1:  # FSDP2; on GPUs bf16 compute with fp32 master weights and reductions
        distributed.shard(model, mixed_precision=cfg.device.startswith("cuda"))
    tok = load_tokenizer(tok_dir)
    train_rows = load_rows(cfg.train_data) if cfg.train_data else toy_rows(20000, seed=cfg.seed, split="train")
    val_rows = load_rows(cfg.val_data) if cfg.val_data else toy_rows(1000, seed=cfg.seed, split="test")
    return model, tok, tok_dir, train_rows, val_rows[:cfg.eval_prompts or None], resume_dir


def main(cfg: Config):
    rank, world, cfg.device = distributed.init(cfg.device)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")  # data.py
    if cfg.train_prompts % world or cfg.mini_batch_prompts % world or cfg.gen_prompts % world:
        raise ValueError(f"--train-prompts, --mini-batch-prompts and --gen-prompts must be multiples of the "
                         f"{world} processes (each rank trains whole groups)")
    # one GPU: fp32 weights, bf16 compute by autocast (under FSDP the mixed-precision policy does this instead)
    autocast = torch.autocast("cuda", torch.bfloat16) if cfg.device.startswith("cuda") and world == 1 \
        else contextlib.nullcontext()
    with autocast:
        return train(cfg, rank, world)


def train(cfg, rank, world):
    model, tok, tok_dir, train_rows, val_rows, resume_dir = setup(cfg)
    G, quota = cfg.group_size, cfg.train_prompts // world  # groups this rank trains per step
    eps_high = cfg.eps_high if cfg.clip_higher else cfg.eps_low  # technique 1 off: the symmetric clip of PPO/GRPO
    new_eval_generator = lambda: torch.Generator(cfg.device).manual_seed(cfg.seed + 1 + rank)  # same draws each time
    if cfg.eval_only:
        result = evaluate(model, val_rows, tok, cfg, new_eval_generator())
        if rank == 0:
            print(json.dumps(result))
        distributed.shutdown()
        return result
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.999), weight_decay=cfg.weight_decay)
    prompt_iter = PromptIterator(train_rows, cfg.gen_prompts if cfg.dynamic_sampling else cfg.train_prompts, cfg.seed)
    generator = torch.Generator(cfg.device).manual_seed(cfg.seed + rank)
    start = checkpoint.load_trainer_state(resume_dir, opt, prompt_iter, generator) if resume_dir else 0
    metrics_file = open(os.path.join(cfg.out_dir, "metrics.jsonl"), "a" if resume_dir else "w") if rank == 0 else None
    log = lambda m: metrics_file and (metrics_file.write(json.dumps(m) + "\n"), metrics_file.flush())
    say = lambda text: rank == 0 and tqdm.write(text)
    first_val = last_val = None
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="dapo", dynamic_ncols=True,
               disable=rank != 0)
    for step in bar:
        if cfg.eval_every and step % cfg.eval_every == 0:
            last_val = evaluate(model, val_rows, tok, cfg, new_eval_generator())
            first_val = first_val or last_val
            log({"step": step, **last_val})
        t0 = time.time()
        for group in opt.param_groups:  # linear warm-up over the first rollout steps, then constant (paper Sec. 4.1)
            group["lr"] = cfg.lr * min(1.0, (step + 1) / max(1, cfg.warmup_steps))

        # --- Rollout (Algorithm 1, lines 3-7): pi_old = the current policy samples G responses per prompt ---
        kept, seen, n_gen = [], [], 0
        while distributed.all_reduce(len(kept), "min", cfg.device) < quota:  # every rank fills its share
            if cfg.max_gen_batches and n_gen == cfg.max_gen_batches:
                # verl raises here; small models hit this wall, so train on what was kept, and say so
                say(f"step {step + 1}: dynamic sampling stopped at max_gen_batches={cfg.max_gen_batches} with "
                    f"{len(kept) * world}/{cfg.train_prompts} informative groups; training on those")
                break
            with distributed.gathered(model):  # under FSDP: gather the weights once for the whole generation
                groups = rollout(model, prompt_iter.next_batch()[rank::world], tok, cfg, G, cfg.temperature,
                                 cfg.top_p, cfg.top_k, generator)
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
        # exactly the training batch, in whole groups, the same number on every rank; the surplus is discarded
        kept = kept[:int(distributed.all_reduce(min(len(kept), quota), "min", cfg.device))]
        samples = [s for g in kept for s in g]
        t_gen = time.time() - t0

        m = {"step": step + 1, **rollout_metrics(seen, kept, n_gen, cfg)}
        if samples:
            # --- Group advantages (paper Eq. 9), one per response, broadcast to its tokens ---
            adv = group_advantages(torch.tensor([s["reward"] for s in samples]), G)  # (N,)
            for s, a in zip(samples, adv.tolist()):
                s["adv"] = a
            m.update(update_policy(model, opt, samples, tok, cfg, eps_high))
        t_train = time.time() - t0 - t_gen
        m.update({"actor/lr": opt.param_groups[0]["lr"], "timing/gen_s": t_gen, "timing/train_s": t_train,
                  "perf/tokens_per_s": m.pop("train/tokens", 0) / max(t_gen + t_train, 1e-9)})
        log(m)
        bar.set_postfix({"reward": f"{m['critic/rewards/mean']:.2f}", "acc": f"{m['acc']:.2f}",
                         "entropy": f"{m.get('actor/entropy', float('nan')):.2f}",
                         "len": f"{m['response_length/mean']:.1f}"})
        if (cfg.save_every and (step + 1) % cfg.save_every == 0) or step + 1 == cfg.steps:
            checkpoint.save(cfg.out_dir, step + 1, model, tok_dir, opt, prompt_iter, generator, asdict(cfg))
    if cfg.eval_every and start < cfg.steps:
        last_val = evaluate(model, val_rows, tok, cfg, new_eval_generator())
        log({"step": cfg.steps, **last_val})
        if first_val:
            k = cfg.eval_samples
            say(f"val/acc (avg@{k}): {first_val['val/acc']:.3f} at step {start} -> {last_val['val/acc']:.3f} at "
                f"step {cfg.steps}; pass@{k}: {first_val[f'val/pass@{k}']:.3f} -> {last_val[f'val/pass@{k}']:.3f}")
    if metrics_file:
        metrics_file.close()
    distributed.shutdown()
    return last_val


def rollout_metrics(seen, kept, n_gen, cfg):
    """What the policy did this step, over every response generated (before the dynamic-sampling filter), summed
    over ranks."""
    flat = [s for g in seen for s in g]
    acc = torch.tensor([[s["acc"] for s in g] for g in seen], dtype=torch.float).view(-1, cfg.group_size)
    n, score, reward, right, length, truncated, kept_n, all_right, all_wrong = distributed.all_reduce([
        float(len(flat)), sum(s["score"] for s in flat), sum(s["reward"] for s in flat), acc.sum().item(),
        float(sum(len(s["response"]) for s in flat)), float(sum(s["truncated"] for s in flat)), float(len(kept)),
        (acc.min(1).values == 1).sum().item(), (acc.max(1).values == 0).sum().item()], device=cfg.device)
    longest = distributed.all_reduce(float(max(len(s["response"]) for s in flat)), "max", cfg.device)
    return {
        "critic/score/mean": score / n, "critic/rewards/mean": reward / n, "acc": right / n,
        "response_length/mean": length / n, "response_length/max": longest,
        "response_length/clip_ratio": truncated / n,
        "train/num_gen_batches": n_gen, "train/groups_kept": int(kept_n),
        "train/groups_filtered": int(n / cfg.group_size - kept_n),
        "train/frac_all_correct": all_right * cfg.group_size / n,
        "train/frac_all_wrong": all_wrong * cfg.group_size / n,
    }


def update_policy(model, opt, samples, tok, cfg, eps_high):
    """Algorithm 1, lines 10-11: one epoch over the batch in mini-batches (one optimizer step each) of micro-batches
    (gradient accumulation). Under torch.distributed each rank holds its share of every mini-batch. Returns the step's
    training metrics, summed over ranks."""
    model.train()
    T, pad, world = cfg.temperature, tok.pad_token_id, distributed.world_size()
    mini = cfg.mini_batch_prompts // world * cfg.group_size  # this rank's sequences per optimizer step
    micro = cfg.micro_batch_size
    micro_batches = lambda batch: [batch[i:i + micro] for i in range(0, len(batch), micro)]
    # pi_old (Algorithm 1, line 4): with several optimizer steps per rollout the policy moves between them, so the
    # log-probs of the policy that sampled the batch are recomputed now, by the training model (the sampler's own
    # differ in the last bits: its cached path sums in another order). With one step, pi_old = pi_theta.detach().
    if len(samples) > mini:
        with torch.no_grad():
            for mb in micro_batches(samples):
                logp, _, _ = response_logprobs(model, [s["prompt"] for s in mb], [s["response"] for s in mb], pad, T)
                for s, lp in zip(mb, logp):
                    s["old_logp"] = lp[:len(s["response"])].float()
    sums, n_tokens_total, n_updates, n_skipped, grad_norms, trained = {}, 0, 0, 0, [], 0
    for i in range(0, len(samples), mini):
        batch = samples[i:i + mini]
        for s in batch:  # overlong filtering (an ablation row): truncated responses stay out of the loss
            s["in_loss"] = not (cfg.overlong_filtering and s["truncated"])
        in_loss = [s["in_loss"] for s in batch]
        # --- DAPO technique 3: the token-level loss's denominator, counted over the whole mini-batch on every rank
        # before it is split into micro-batches, so the gradient does not depend on the split (SPEC 1, the trap) ---
        n_tokens, n_seqs = distributed.all_reduce(
            [float(sum(len(s["response"]) for s, keep in zip(batch, in_loss) if keep)), float(sum(in_loss))],
            device=cfg.device)
        if n_tokens == 0:
            continue
        for mb in micro_batches(batch):
            logp, entropy, mask = response_logprobs(model, [s["prompt"] for s in mb], [s["response"] for s in mb],
                                                    pad, T)  # (B, R) x 3
            mask = mask & torch.tensor([s["in_loss"] for s in mb], device=mask.device)[:, None]
            old_logp = torch.zeros_like(logp)
            for j, s in enumerate(mb):
                old_logp[j, :len(s["response"])] = s["old_logp"] if "old_logp" in s else logp[j, :len(s["response"])]
            adv = torch.tensor([s["adv"] for s in mb], device=logp.device)  # (B,)
            # the naive GRPO alternative: each sequence's mean, then the mean over sequences (technique 3 off)
            denom = n_tokens if cfg.token_level_loss else mask.sum(-1, keepdim=True).clamp(min=1) * n_seqs
            # --- DAPO technique 1: clip-higher, inside the clipped surrogate (paper Sec. 3.1, Eq. 10) ---
            loss, stats = policy_loss(logp, old_logp.detach(), adv, mask, cfg.eps_low, eps_high, denom, cfg.dual_clip)
            (loss * world).backward()  # FSDP averages gradients over ranks; the loss is already a global mean
            stats["actor/entropy"] = (entropy.detach() * mask).sum()
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v.item()
            trained += sum(len(s["prompt"]) + len(s["response"]) for s in mb)
        n_tokens_total += n_tokens
        grad_norm = distributed.as_local(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
        if torch.isfinite(grad_norm):
            opt.step()
            n_updates += 1
        else:  # a NaN/inf anywhere in the gradient: skip this update (it never reaches the weights or a checkpoint)
            n_skipped += 1
            if distributed.rank() == 0:
                tqdm.write(f"non-finite gradient norm ({grad_norm.item()}): update skipped")
        opt.zero_grad(set_to_none=True)
        grad_norms.append(grad_norm.item())
    keys = sorted(sums)
    totals = distributed.all_reduce([sums[k] for k in keys] + [float(trained)], device=cfg.device)
    out = {k: v / max(n_tokens_total, 1) for k, v in zip(keys, totals)}
    out["actor/pg_clipfrac"] = out.get("actor/pg_clipfrac_high", 0.0) + out.get("actor/pg_clipfrac_low", 0.0)
    finite = [g for g in grad_norms if math.isfinite(g)]
    out.update({"actor/grad_norm": sum(finite) / len(finite) if finite else float("nan"),
                "train/updates": n_updates, "train/skipped_updates": n_skipped, "train/tokens": totals[-1]})
    return out


if __name__ == "__main__":
    main(parse_args())
