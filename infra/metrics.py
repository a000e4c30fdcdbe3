"""
What a run logs: one row of metrics.jsonl per rollout step (and one per evaluation), the progress
bar, and the sums the update gathers to make them. Every number is summed over ranks before it is
divided, so N processes log what one process would. docs/metrics.md says what each name means;
verl's names keep verl's meanings (where this project's differ, it says so there).
"""
import json
import math
import os

import torch
from tqdm import tqdm

from infra import distributed, files, health, rollout_correction

# sums over the loss's tokens (clip_stats), then pi_old's entropy and the tokens in the loss
STAT_NAMES = ("pg_loss", "clip_high", "clip_low", "dual_clip", "kl", "up_clipped_prob",
              "token_prob", "entropy", "tokens")
# the sampler's log-probs against the trainer's pi_old, over every response token: |p - p'|
# (verl's rollout_probs_diff), |log p - log p'| and |p / p' - 1| (how far off the ratio is)
PARITY_NAMES = ("probs_diff", "logp_diff", "ratio_diff")


@torch.no_grad()
def clip_stats(out, logp, old_logp, adv, loss_mask, weight=None) -> dict:
    """Sums over the tokens in the loss of what the clipped surrogate did, read from its own
    per-token loss and ratio (`out`, a losses.PolicyLoss), so that an edited loss logs its own clip:
    a clip bound binds where it raised the token's loss above the unclipped -A r (verl's
    pg_clipfrac: the clipped loss > the unclipped one), and the dual clip where it lowered the
    loss below -A r (nothing else can). A loss that names its bound's tokens (out.clipped: CISPO's
    clipped weights, KL-Cov's penalised tokens) is read by it, high and low by the ratio's side
    (verl's cispo counts both in pg_clipfrac). Also the first-order KL, and the paper's Fig. 3a
    (pi_old of the up-clipped tokens) and Fig. 7d (mean token probability). logp, old_logp,
    loss_mask (B, R); adv (B,); weight the rollout correction's (B, R), as in the loss, or None.
    Tensors of one element."""
    mask = loss_mask.float()
    adv = adv[:, None]  # one per response, (B, 1)
    unclipped = -adv * out.ratio  # (B, R)
    clipped, dual = out.loss_tok > unclipped, out.loss_tok < unclipped  # (B, R)
    up_clipped, down_clipped = clipped & (adv > 0), clipped & (adv < 0)  # (B, R)
    if out.clipped is not None:  # the loss says where its bound acted (CISPO, KL-Cov): each side
        up_clipped, down_clipped = out.clipped & (out.ratio > 1), out.clipped & (out.ratio <= 1)
        dual = torch.zeros_like(out.clipped)
    old_prob = old_logp.exp() * mask
    return {
        "pg_loss": ((out.loss_tok if weight is None else out.loss_tok * weight) * mask).sum(),
        "clip_high": (up_clipped * mask).sum(),
        "clip_low": (down_clipped * mask).sum(),
        "dual_clip": (dual * mask).sum(),
        "kl": ((old_logp - logp) * mask).sum(),  # first-order KL(pi_old || pi)
        "up_clipped_prob": (old_prob * up_clipped).sum(),  # rare tokens the clip stops
        "token_prob": old_prob.sum(),
    }


class UpdateStats:
    """The sums update_policy gathers over its micro-batches and optimizer steps, reduced over
    ranks once, at the end, into the step's actor/ and dapo/ metrics."""

    def __init__(self):
        self.sums = dict.fromkeys(STAT_NAMES, 0.0)
        self.grad_norms, self.updates, self.skipped = [], 0, 0
        self.parity_sums = dict.fromkeys(("tokens",) + PARITY_NAMES, 0.0)
        self.parity_max = dict.fromkeys(PARITY_NAMES, 0.0)
        self.correction = rollout_correction.Stats()  # the rollout_corr/ metrics

    def add_loss(self, out, logp, old_logp, adv, loss_mask, correction):
        """A micro-batch's loss: `out` (losses.PolicyLoss) from logp, old_logp (B, R) and adv (B,)
        over loss_mask (B, R), with the rollout correction's weights (rollout_correction.py)."""
        for k, v in clip_stats(out, logp, old_logp, adv, loss_mask, correction.weight).items():
            self.sums[k] += v.item()
        self.sums["tokens"] += loss_mask.sum().item()
        self.correction.add_weights(correction, loss_mask)

    def add_old_policy(self, old_logp, entropy, batch):
        """pi_old's log-probs and entropy (B, R) on a (micro-)batch.Batch's response tokens: its
        entropy, and its distance to the sampler's log-probs (add_parity). A filler micro-batch
        (Batch.masked_first_row) has none."""
        self.add_entropy(entropy, batch.response_mask)
        self.add_parity(old_logp, batch.rollout_logp, batch.response_mask)

    def add_entropy(self, entropy, response_mask):
        """pi_old's entropy, summed over every response token (not only the loss's)."""
        self.sums["entropy"] += (entropy.detach() * response_mask).sum().item()

    @torch.no_grad()
    def add_parity(self, logp, rollout_logp, response_mask):
        """How far the trainer's pi_old log-probs (B, R) are from the sampler's for the same
        tokens, in float64 (so that the figure is the two computations' difference, not this
        sum's round-off). Skipped for a batch made without a sampler (rollout_logp None)."""
        if rollout_logp is None:
            return
        mask = response_mask
        train, rollout = logp.double()[mask], rollout_logp.double()[mask]  # (tokens,)
        diffs = {"probs_diff": (train.exp() - rollout.exp()).abs(),
                 "logp_diff": (train - rollout).abs(),
                 "ratio_diff": (train - rollout).exp().sub(1).abs()}
        self.parity_sums["tokens"] += len(train)
        for name, d in diffs.items():
            self.parity_sums[name] += d.sum().item()
            # NaN wins: a NaN log-prob on either side must show in the max
            worst = d.max().item() if len(d) else 0.0
            self.parity_max[name] = nan_max(self.parity_max[name], worst)
        self.correction.add_mismatch(logp, rollout_logp, mask)

    def parity(self) -> dict:
        """training/rollout_{probs,logp,ratio}_diff_{mean,max}, over ranks; {} without any."""
        sums = dict(zip(self.parity_sums, distributed.all_reduce(list(self.parity_sums.values()))))
        if not sums["tokens"]:
            return {}
        worst = distributed.all_reduce(list(self.parity_max.values()), "max")
        out = {}
        for name, top in zip(PARITY_NAMES, worst):
            out[f"training/rollout_{name}_mean"] = sums[name] / sums["tokens"]
            out[f"training/rollout_{name}_max"] = top
        return out

    def add_step(self, grad_norm: float, stepped: bool):
        self.grad_norms.append(grad_norm)
        self.updates += stepped
        self.skipped += not stepped

    def result(self, batch) -> dict:
        sums = self.sums | {
            "all_tokens": batch.response_mask.sum().item(),
            "trained_tokens": (batch.prompt_mask.sum() + batch.response_mask.sum()).item()}
        s = dict(zip(sums, distributed.all_reduce(list(sums.values()))))
        finite = [g for g in self.grad_norms if math.isfinite(g)]
        tokens, all_tokens = max(s["tokens"], 1), max(s["all_tokens"], 1)
        return {
            "actor/pg_loss": s["pg_loss"] / tokens,
            "actor/pg_clipfrac": (s["clip_high"] + s["clip_low"]) / tokens,  # either bound binds
            "actor/pg_clipfrac_lower": s["dual_clip"] / tokens,  # the dual clip binds
            "actor/ppo_kl": s["kl"] / tokens,
            "actor/entropy": s["entropy"] / all_tokens,  # of pi_old, before the update
            "actor/grad_norm": sum(finite) / len(finite) if finite else float("nan"),
            "dapo/clipfrac_high": s["clip_high"] / tokens,
            "dapo/clipfrac_low": s["clip_low"] / tokens,
            "dapo/up_clipped_prob": s["up_clipped_prob"] / max(s["clip_high"], 1),
            "dapo/token_prob": s["token_prob"] / tokens,
            "train/updates": self.updates, "train/skipped_updates": self.skipped,
            "train/tokens": s["trained_tokens"],
        } | self.parity() | self.correction.result()


def nan_max(a: float, b: float) -> float:
    """max(a, b), NaN if either is NaN (Python's max keeps whichever comes first)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def rollout_metrics(seen, group_size: int) -> dict:
    """What the policy did this step, over every response generated (a batch.Batch, before the
    filter), summed over ranks."""
    acc = seen.acc.float().view(-1, group_size)  # (groups, G)
    lengths = seen.response_lengths.float()
    no_answer = seen.no_answer if seen.no_answer is not None else torch.zeros_like(seen.acc)
    sums = {
        "n": len(seen), "score": seen.score.sum().item(), "reward": seen.reward.sum().item(),
        "right": acc.sum().item(), "length": lengths.sum().item(),
        "truncated": seen.truncated.sum().item(),
        "all_right": (acc.min(1).values == 1).sum().item(),
        "all_wrong": (acc.max(1).values == 0).sum().item(),
        "finished": (~seen.truncated).sum().item(),
        "no_answer": no_answer.sum().item(),
        "no_answer_finished": (no_answer & ~seen.truncated).sum().item(),
        "reward_fn_error": seen.reward_error.sum().item() if seen.reward_error is not None else 0,
    }
    s = dict(zip(sums, distributed.all_reduce([float(v) for v in sums.values()])))
    n, groups = s["n"], s["n"] / group_size
    out = {
        "rollout/acc": s["right"] / n, "rollout/score/mean": s["score"] / n,
        "rollout/reward/mean": s["reward"] / n, "rollout/response_length/mean": s["length"] / n,
        "rollout/response_length/max": distributed.all_reduce(lengths.max().item(), "max"),
        "rollout/truncated": s["truncated"] / n,
        "rollout/frac_all_correct": s["all_right"] / groups,
        "rollout/frac_all_wrong": s["all_wrong"] / groups,
        "rollout/no_answer": s["no_answer"] / n,
    }
    if s["finished"]:  # of the responses that ended: the format, not the length
        out["rollout/no_answer_finished"] = s["no_answer_finished"] / s["finished"]
    if seen.reward_error is not None:  # with --reward-fn: the responses it raised on
        out["rollout/reward_fn_error"] = s["reward_fn_error"] / n
    return out


def generation_cost(generated, trained, n_groups_trained: int, extra_s: float) -> dict:
    """What dynamic sampling cost this step: response tokens generated (batch.Batch `generated`,
    every response) per group trained on, the fraction of them not trained on (filtered out, or
    kept beyond --train-prompts), and the seconds spent on generation batches after the first.
    Summed over ranks; `trained` is None when nothing was."""
    n_generated, n_trained = distributed.all_reduce(
        [generated.response_mask.sum().item(),
         trained.response_mask.sum().item() if trained is not None else 0])
    out = {"train/gen_tokens_discarded": 1 - n_trained / max(n_generated, 1),
           "timing/gen_extra_s": extra_s}
    if n_groups_trained:
        out["train/gen_tokens_per_group"] = n_generated / n_groups_trained
    return out


def collection_metrics(generated, to_train, n_kept: int, n_groups_trained: int,
                       gen_end_times: list[float], group_size: int, train_prompts: int,
                       prompts_per_gen: int) -> dict:
    """A step's rollout metrics (every response generated), dynamic sampling's bookkeeping and
    its cost, and the training batch's (None when nothing was kept); gen_end_times: when each
    generation batch ended."""
    n_gen, cap_hit = len(gen_end_times), n_kept < train_prompts
    extra_s = gen_end_times[-1] - gen_end_times[0] if gen_end_times else 0.0
    return (rollout_metrics(generated, group_size)
            | sampling_metrics(n_gen, n_kept, n_groups_trained, cap_hit, prompts_per_gen)
            | generation_cost(generated, to_train, n_groups_trained, extra_s)
            | (training_batch_metrics(to_train) if to_train is not None else {}))


def sampling_metrics(n_gen: int, n_kept: int, n_groups_trained: int, cap_hit: bool,
                     prompts_per_gen: int) -> dict:
    """Dynamic sampling's bookkeeping: generation batches drawn, groups kept, trained, left over
    and filtered out (all right or all wrong)."""
    return {"train/num_gen_batches": n_gen, "train/gen_cap_hit": int(cap_hit),
            "train/groups_kept": n_groups_trained,
            "train/groups_surplus": n_kept - n_groups_trained,
            "train/groups_filtered": n_gen * prompts_per_gen - n_kept}


def training_batch_metrics(batch) -> dict:
    """verl's data metrics, with verl's meanings: over the batch that is trained on, the score is
    the reward the advantage is computed from (the overlong penalty included); with no KL term
    the "rewards" are the same."""
    lengths = batch.response_lengths.float()
    n, reward, length, truncated = distributed.all_reduce(
        [len(batch), batch.reward.sum().item(), lengths.sum().item(),
         batch.truncated.sum().item()])
    return {"critic/score/mean": reward / n, "critic/rewards/mean": reward / n,
            "response_length/mean": length / n, "response_length/clip_ratio": truncated / n,
            "response_length/max": distributed.all_reduce(lengths.max().item(), "max")}


def log_settings(metrics_path: str, config: dict):
    """metrics.jsonl's first row, {"step": 0, "config": {flag: value}}: the flags the run started
    with, resolved (--precision auto as the bf16 or fp32 it chose, the Hub names as their
    snapshots' paths), so that its rows say how they were made. An inf is written "inf" (a
    --reward-timeout without limit), as strict JSON has no inf."""
    config = {k: str(v) if isinstance(v, float) and not math.isfinite(v) else v
              for k, v in config.items()}
    # written whole, by rank 0: what a start finds there is at most the settings of a run that
    # died before its first row (checkpoint.prepare_out_dir refuses anything more)
    if distributed.rank() == 0:
        files.write_atomic(metrics_path, json.dumps({"step": 0, "config": config}) + "\n")


class RunLog:
    """metrics.jsonl (appended by rank 0) and the progress bar of the rollout steps; every row also
    goes to the trackers of --report-to (infra/trackers.py, rank 0 only), at its step."""

    def __init__(self, path: str, start: int, steps: int, trackers: list = ()):
        self.path, self.trackers = path, list(trackers)
        self.capped = 0  # steps at which dynamic sampling stopped at --max-gen-batches
        self.first_val = self.last_val = None  # the run's first and latest evaluation
        self.first_step = self.last_step = 0  # the rollout steps they came before
        self.bar = tqdm(initial=start, total=steps, desc="dapo", dynamic_ncols=True,
                        disable=distributed.rank() != 0)

    def write(self, row: dict):
        if distributed.rank() == 0:
            files.append_line(self.path, json_line(row))
            for tracker in self.trackers:
                tracker.log(row, row["step"])

    def evaluated(self, step: int, result: dict):
        """An evaluation's row, before rollout step `step` (or after the last)."""
        if self.first_val is None:  # a resumed run's first is its own, not step `start`'s
            self.first_step, self.first_val = step, result
        self.last_step, self.last_val = step, result
        self.write({"step": step, **result})

    def step(self, step: int, row: dict, lr: float, t_gen: float, t_train: float):
        """The row of rollout step `step` (1-based), with its learning rate and timings."""
        tokens = row.pop("train/tokens", 0)
        row |= {"step": step, "actor/lr": lr, "timing/gen_s": t_gen, "timing/train_s": t_train,
                "perf/tokens_per_s": tokens / max(t_gen + t_train, 1e-9)}
        self.write(row)
        if row.get("train/gen_cap_hit"):
            self.capped += 1
            if self.capped == 1:  # said once, then counted in the bar
                distributed.say(cap_note(row))
        self.bar.set_postfix(progress_summary(row) | ({"capped": self.capped} if self.capped
                                                      else {}), refresh=False)
        self.bar.update()
        if step == self.bar.total:
            self.bar.close()

    def say_eval_change(self, k: int):
        first, last = self.first_val, self.last_val
        if first is not last:  # two evaluations or more
            distributed.say(f"val/acc (avg@{k}): {first['val/acc']:.3f} at step "
                            f"{self.first_step} -> {last['val/acc']:.3f} at step "
                            f"{self.last_step}; pass@{k}: "
                            f"{first[f'val/pass@{k}']:.3f} -> {last[f'val/pass@{k}']:.3f}")


def json_line(row: dict) -> str:
    """The row as one line of strict JSON: a NaN or an inf (a grad norm when every update was
    skipped) becomes null, as json.dumps's bare NaN is refused by jq, JavaScript and other strict
    readers. plot.py and the trackers skip a null as they skip a NaN."""
    return json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v
                       for k, v in row.items()})


def cap_note(row: dict) -> str:
    kept = row["train/groups_kept"] + row["train/groups_surplus"]
    return (f"step {row['step']}: dynamic sampling stopped at --max-gen-batches "
            f"({row['train/num_gen_batches']} generation batches) with {kept} groups with "
            f"signal, fewer than --train-prompts; trained on the {row['train/groups_kept']} of "
            "whole mini-batches. Said once: 'capped' in the bar counts such steps "
            "(train/gen_cap_hit in metrics.jsonl)")


def eval_metrics(batch, n_mine: int, n_rows: int, k: int, verifier=None) -> dict:
    """val/acc (avg@k) and val/pass@k over every rank's problems, n_rows in all: this rank's are
    the first n_mine groups of k responses of batch (a rank without a problem sampled one to
    ignore). With --reward-fn, val/reward_fn_error: the share of responses it raised on, and a
    warning that quotes the first error of `verifier` (reward.Verifier), as a step's does."""
    acc = batch.acc.float().view(-1, k)[:n_mine]  # (problems, k)
    raised = 0 if batch.reward_error is None else \
        batch.reward_error.view(-1, k)[:n_mine].sum().item()
    right, any_right, raised = distributed.all_reduce(
        [acc.sum().item(), acc.amax(1).sum().item(), raised])
    out = {"val/acc": right / (n_rows * k), f"val/pass@{k}": any_right / n_rows}
    if batch.reward_error is not None:
        out["val/reward_fn_error"] = raised / (n_rows * k)
    if verifier is not None:
        health.warn_evaluation(out, verifier.spec, verifier.take_errors(), batch)
    return out


def report_eval(result: dict, out_dir: str, config: dict, trackers: list):
    """--eval-only's result: printed, written beside the flags that produced it as
    out_dir/eval.json (by rank 0; the next --eval-only there replaces it), and logged to the
    trackers (runs of their own, apart from any training run's)."""
    path = os.path.join(out_dir, "eval.json")
    if distributed.rank() == 0:
        os.makedirs(out_dir, exist_ok=True)
        files.write_atomic(path, json.dumps({**result, "config": config}, indent=2) + "\n")
    distributed.say(f"written to {path}:\n{json.dumps(result)}")
    for tracker in trackers:
        tracker.log(result, 0)


def progress_summary(m: dict) -> dict:
    """The progress bar's numbers: the rollout's, and the policy's entropy when it trained."""
    out = {"acc": f"{m['rollout/acc']:.2f}", "reward": f"{m['rollout/reward/mean']:.2f}",
           "len": f"{m['rollout/response_length/mean']:.1f}"}
    if "actor/entropy" in m:  # no update when dynamic sampling kept less than a mini-batch
        out["entropy"] = f"{m['actor/entropy']:.2f}"
    if "train/gen_tokens_discarded" in m:  # the generation dynamic sampling threw away
        out["thrown"] = f"{m['train/gen_tokens_discarded']:.0%}"
    return out
