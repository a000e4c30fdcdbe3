"""Alarms for a run that has gone dead: after each rollout step, one line naming the cause and
the flag that fixes it; with --stop-when-stuck N the run stops (checkpoint, non-zero exit) after
N consecutive dead steps, and a run that took no optimizer step (every update skipped, or none
to take) never exits 0. Three more warnings, for a run that trains on something wrong: responses
without an answer the verifier can read, sampler log-probs that disagree with the trainer's, and
a --reward-fn that raised. And a bound on dynamic sampling that finds no signal at all.

check_finite() guards the weights after every optimizer step (infra/precision.py's
optimizer_step) and before every checkpoint: weights that went bad stop the run before they reach
a checkpoint."""

from infra import distributed
from infra.errors import UserError
from infra.hf_io import first_nonfinite

TRUNCATED_ALARM = 0.9  # almost every response truncated
NO_ANSWER_ALARM = 0.9  # of the responses that ended, the verifier read no answer in almost all
# nats per token, the mean |log p_sampler - log p_trainer| over the step's response tokens.
# Measured on the tiny model (tests/test_parity.py): fp32 on CPU 1e-7; a temperature applied
# twice 0.3, log-probs renormalised after top-p 0.9 0.1; a bf16 sampler beside the fp32 trainer
# 0.002 on the demo's base model (experiments/rollout_mismatch.py). bf16 on a GPU rounds both sides
# more (not measured here): 0.05 leaves it room.
PARITY_ALARM = 0.05
EXAMPLE_CHARS = 200  # of the response shown with the no-answer warning: its end, where answers go
ENTROPY_FLOOR = 1e-3  # nats per token: the policy has collapsed onto one answer
PROGRESS_EVERY = 8  # generation batches between progress lines when sampling runs long
NO_SIGNAL_BOUND = 64  # generation batches without one group with signal: give up
# of the responses, --reward-fn raised on this many (each scored as wrong): a step without signal
# is then blamed on the function, not on the prompt's format
REWARD_FN_ERROR_ALARM = 0.5


class RunStuck(RuntimeError):
    """The run trained on nothing for --stop-when-stuck consecutive steps."""


def dead_step_causes(row: dict, reward_fn: str = "") -> list[str]:
    """The causes that make this step's update worthless, each with its fix, from the step's
    metrics row (infra/metrics.py's names). Empty when the step is healthy. reward_fn: the
    --reward-fn in use, named when its errors are the cause."""
    causes = []
    truncated = row.get("rollout/truncated", 0.0)
    if truncated >= TRUNCATED_ALARM:
        causes.append(f"{truncated:.0%} of responses truncated: raise --max-response-len")
    surplus = row.get("train/groups_surplus", 0)
    raised = row.get("rollout/reward_fn_error", 0.0)
    if row.get("train/groups_kept", 1) == 0 and surplus:
        causes.append(f"only {surplus} groups with signal, fewer than --mini-batch-prompts: "
                      "nothing trained; raise --max-gen-batches or --gen-prompts")
    elif row.get("train/groups_kept", 1) == 0 and raised >= REWARD_FN_ERROR_ALARM:
        causes.append(f"no group with signal: {_flag(reward_fn)} raised on {raised:.0%} of the "
                      "responses, each scored as a wrong answer; fix the function (its first "
                      "error is below)")
    elif row.get("train/groups_kept", 1) == 0:
        causes.append(
            f"no group with signal (all right {row.get('rollout/frac_all_correct', 0):.0%}, "
            f"all wrong {row.get('rollout/frac_all_wrong', 0):.0%} of groups): nothing trained; "
            "check that the prompt asks for the answer format the verifier reads, or that "
            "the task suits the model")
    skipped = row.get("train/skipped_updates", 0)
    if skipped and not row.get("train/updates", 0):
        causes.append(f"all {skipped} optimizer steps skipped (a NaN or inf gradient norm): "
                      "nothing trained; look for a NaN in the rewards or the advantages, or "
                      "lower --lr")
    entropy = row.get("actor/entropy")
    if entropy is not None and not (entropy >= ENTROPY_FLOOR):  # NaN fails the comparison too
        causes.append(f"actor/entropy {entropy:.3g}: the policy has collapsed or diverged; "
                      "lower --lr or resume from an earlier checkpoint")
    return causes


def wrong_signal_causes(row: dict, example: str = "") -> list[str]:
    """Warnings for a step that trains on a signal that is wrong rather than on none: the
    verifier read no answer (the prompt's format and the verifier's disagree; `example`, the end
    of one such response), or the sampler's log-probs are not the trainer's pi_old."""
    causes = []
    no_answer = row.get("rollout/no_answer_finished", 0.0)
    if no_answer >= NO_ANSWER_ALARM:
        causes.append(f"the verifier found no answer in {no_answer:.0%} of the responses that "
                      "ended: check that the prompt asks for the format the verifier reads (or "
                      f"--reward-fn); one ends {example!r}")
    parity = row.get("training/rollout_logp_diff_mean", 0.0)
    if not parity <= PARITY_ALARM:  # NaN too
        causes.append(f"training/rollout_logp_diff_mean {parity:.3g}: the sampler's log-probs "
                      "are not the trainer's (a temperature or top-p applied on one side only, "
                      "or another dtype); the importance ratio is off by as much. A real "
                      "sampler/trainer gap (bf16, other kernels): --rollout-correction "
                      "token_truncate or sequence_mask weighs each token by pi_old / pi_sampler")
    return causes


def reward_fn_warning(share: float, reward_fn: str, first_error: str, generated=None) -> str:
    """The step's one line on --reward-fn `reward_fn` raising: on what share of the responses (of
    every rank) and how many of this rank's (generated, a batch.Batch), scored as wrong answers,
    and the first error with its response ("" when it was on another rank)."""
    count = ""
    if generated is not None and generated.reward_error is not None:
        where = " on rank 0" if distributed.world_size() > 1 else ""
        count = f" ({int(generated.reward_error.sum())} of {len(generated)}{where})"
    return (f"{_flag(reward_fn)} raised on {share:.0%} of the responses{count}, each scored as a "
            f"wrong answer (-1); the first: {first_error or '(on another rank)'}")


def warn_evaluation(result: dict, reward_fn: str, first_error: str, generated):
    """An evaluation's line on --reward-fn raising (result: evaluate()'s val/ metrics; generated:
    this rank's responses), as a step's: else the evaluation's accuracy would fall unexplained."""
    if result.get("val/reward_fn_error"):
        distributed.say("warning: evaluation: " + reward_fn_warning(
            result["val/reward_fn_error"], reward_fn, first_error, generated))


def _flag(reward_fn: str) -> str:
    return f"--reward-fn {reward_fn}" if reward_fn else "--reward-fn"


def no_answer_example(generated, tok) -> str:
    """The last EXAMPLE_CHARS characters of the first response that ended without an answer the
    verifier could read; generated a batch.Batch of every response of the step."""
    finished = generated.no_answer & ~generated.truncated  # (N,)
    if not finished.any():
        return ""
    i = int(finished.nonzero()[0])
    ids = generated.response_ids[i][generated.response_mask[i]]
    return tok.decode(ids.tolist())[-EXAMPLE_CHARS:]


class Alarms:
    """Warns at once on a dead step or a wrong signal; counts consecutive dead steps against
    --stop-when-stuck (a wrong signal warns every step but does not stop the run)."""

    def __init__(self, stop_when_stuck: int, reward_fn: str = ""):
        self.stop_when_stuck, self.dead_run, self.reward_fn = stop_when_stuck, 0, reward_fn
        self.updates = self.skipped = self.steps = 0  # optimizer steps taken and skipped; steps

    def check(self, step: int, row: dict, generated=None, tok=None,
              reward_fn_error: str = "") -> bool:
        """Say what is wrong with this step, one line a cause; True when the run should stop.
        generated, tok: the step's responses and the tokenizer, for the no-answer warning's
        example; reward_fn_error: the first error --reward-fn raised this step."""
        self.updates += row.get("train/updates", 0)
        self.skipped += row.get("train/skipped_updates", 0)
        self.steps += 1
        causes = dead_step_causes(row, self.reward_fn)
        self.dead_run = self.dead_run + 1 if causes else 0
        example = ""
        if row.get("rollout/no_answer_finished", 0.0) >= NO_ANSWER_ALARM and generated is not None:
            example = no_answer_example(generated, tok)
        warnings = wrong_signal_causes(row, example)
        if row.get("rollout/reward_fn_error"):
            warnings.insert(0, reward_fn_warning(row["rollout/reward_fn_error"], self.reward_fn,
                                                 reward_fn_error, generated))
        for cause in causes + warnings:
            distributed.say(f"warning: step {step}: {cause}")
        return bool(self.stop_when_stuck) and self.dead_run >= self.stop_when_stuck

    def finish(self):
        """At the end of the run: one that took no optimizer step (every update skipped, or none
        to take: no group with signal, or no token in the loss) trained nothing, and says so with
        a non-zero exit (RunStuck) however few steps it had."""
        if self.skipped and not self.updates:
            raise RunStuck(f"all {self.skipped} optimizer steps of this run were skipped (a NaN "
                           "or inf gradient norm): it trained nothing; the warnings above name "
                           "the steps; the checkpoint saved holds the weights it started from")
        if self.steps and not self.updates:
            raise RunStuck(f"none of this run's {self.steps} steps took an optimizer step (no "
                           "group with signal, or no token in the loss): it trained nothing; the "
                           "warnings above name the cause; the checkpoint saved holds the "
                           "weights it started from")

    def raise_stuck(self):
        """Stop the run: --stop-when-stuck consecutive dead steps (check() said True)."""
        raise RunStuck(f"stopping: {self.dead_run} consecutive steps trained on nothing or on a "
                       f"dead policy (--stop-when-stuck {self.stop_when_stuck}; 0 = never "
                       "stop); the warnings above name the cause; a checkpoint was saved")


def check_sampling(n_gen: int, n_kept: int, train_prompts: int):
    """Dynamic sampling with a high (or no) --max-gen-batches: a progress line every
    PROGRESS_EVERY generation batches, and an error after NO_SIGNAL_BOUND batches that kept
    no group at all (an endless loop otherwise: nothing will ever have signal)."""
    if n_gen and n_gen % PROGRESS_EVERY == 0:
        distributed.say(f"dynamic sampling: {n_gen} generation batches, {n_kept} of "
                        f"{train_prompts} groups with signal so far")
    if n_gen >= NO_SIGNAL_BOUND and n_kept == 0:
        raise UserError(
            f"dynamic sampling found no group with signal in {n_gen} generation batches (every "
            "group all right or all wrong); check --max-response-len, the prompt's answer "
            "format against the verifier, or set --max-gen-batches to train on what is kept")


# --------------------------------------------------------------------------------------------------
# The guard of every optimizer step

def check_finite(model, where: str):
    """Raise on every rank, naming the first parameter that holds a NaN or an inf: such weights
    would train on, reporting only groups without signal, and reach every later checkpoint. Cheap
    enough for every optimizer step: one fused norm over this rank's shards and, under
    torch.distributed, one all-reduce of the first bad index."""
    params = dict(model.named_parameters())  # a tied weight once
    # FSDP shards
    local = {n: distributed.local_shard(p).detach() for n, p in params.items()}
    names = list(local)
    bad = first_nonfinite(local)
    index = names.index(bad) if bad else len(names)
    first = int(distributed.all_reduce(index, "min", name="check_finite"))
    if first < len(names):
        name = names[first]
        counts = local[name].isnan().sum().item(), local[name].isinf().sum().item()
        held = (f"{counts[0]} NaN and {counts[1]} inf value(s)" if any(counts)
                else "NaN/inf values on another rank")
        raise FloatingPointError(f"{where}: parameter {name!r} holds {held}. Stopping before they "
                                 "reach a checkpoint: the last one saved is finite (resume from "
                                 "it, with a lower --lr?)")

