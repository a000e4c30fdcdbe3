"""
The batch of a rollout step: every response to every prompt, as tensors, in one typed record.

rollout() in dapo.py makes one from the sampler's output and the verifier's verdicts; the loop then
adds the shaped reward, the group advantage and pi_old's log-probs with dataclasses.replace, so a
function's signature says which fields it reads. The operations the loop needs:

    batch.groups(keep)      whole groups (dynamic sampling keeps or drops a prompt's G responses)
    batch.split(rows)       mini-batches, one optimizer step each, their padding trimmed
    batch.micro_batches()   micro-batches, by count or by a budget of tokens, as many on every rank
    batch.per_token(fn)     fn's (b, r) results on each micro-batch, put back in (N, R) tensors
    Batch.cat([...])        generation batches accumulated until the training batch is full

and dynamic sampling's buffer, GroupBuffer (add, size, take), whose groups N ranks share out so
that they train on exactly what one process would.

Layout of row i (P = longest prompt, R = longest response of the batch):

    prompt_ids[i]:   pad pad p0 p1 p2        left-padded, so every prompt ends at column P
    response_ids[i]: r0  r1  r2 EOS pad pad  right-padded, so every response starts at column 0
"""
import time
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F

from infra import distributed, health
from infra.errors import UserError


def _longest(mask) -> int:
    return int(mask.sum(-1).max()) if len(mask) else 0


PROMPT_FIELDS = ("prompt_ids", "prompt_mask")  # left-padded
RESPONSE_FIELDS = ("response_ids", "response_mask", "rollout_logp", "old_logp")  # right-padded


@dataclass
class Batch:
    """G responses to each prompt, group after group: rows [i G, (i + 1) G) answer prompt i."""
    prompt_ids: torch.Tensor  # (N, P) long, left-padded
    prompt_mask: torch.Tensor  # (N, P) bool: True on prompt tokens
    response_ids: torch.Tensor  # (N, R) long, right-padded
    response_mask: torch.Tensor  # (N, R) bool: True on response tokens, the EOS included
    score: torch.Tensor  # (N,) fp32: the verifier's +1 (right) or -1 (wrong)
    acc: torch.Tensor  # (N,) bool: the answer is right
    truncated: torch.Tensor  # (N,) bool: cut at max_response_len before any EOS
    group_size: int
    # (N, R) fp32: the sampler's log-prob of each response token (tempered, before top-k/top-p)
    rollout_logp: torch.Tensor | None = None
    no_answer: torch.Tensor | None = None  # (N,) bool: the verifier found no answer to read
    # (N,) bool: --reward-fn raised on it (scored as wrong); None without --reward-fn
    reward_error: torch.Tensor | None = None
    reward: torch.Tensor | None = None  # (N,) fp32: score + overlong penalty (technique 4)
    adv: torch.Tensor | None = None  # (N,) fp32: the group advantage (Eq. 9)
    old_logp: torch.Tensor | None = None  # (N, R) fp32: log pi_old of each response token

    @classmethod
    def from_rollout(cls, rollout, verdicts, group_size: int) -> "Batch":
        """From the sampler's Rollout and the verifier's reward.Verdicts on each response."""
        device = rollout.response_ids.device
        reward_error = None
        if verdicts.reward_error is not None:
            reward_error = torch.tensor(verdicts.reward_error, dtype=torch.bool, device=device)
        return cls(prompt_ids=rollout.prompt_ids, prompt_mask=rollout.prompt_mask,
                   response_ids=rollout.response_ids, response_mask=rollout.response_mask,
                   score=torch.tensor(verdicts.score, device=device),
                   acc=torch.tensor(verdicts.acc, dtype=torch.bool, device=device),
                   truncated=rollout.truncated, group_size=group_size,
                   rollout_logp=rollout.logprobs,
                   no_answer=torch.tensor(verdicts.no_answer, dtype=torch.bool, device=device),
                   reward_error=reward_error)

    def __len__(self):
        return self.prompt_ids.shape[0]

    @property
    def num_groups(self) -> int:
        return len(self) // self.group_size

    @property
    def response_lengths(self):
        return self.response_mask.sum(-1)  # (N,)

    def tensors(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)}

    def rows(self, index) -> "Batch":
        """The rows at `index` (a slice or a tensor of indices), padding columns that none of
        them uses trimmed away."""
        picked = {name: t[index] for name, t in self.tensors().items()}
        P, R = _longest(picked["prompt_mask"]), _longest(picked["response_mask"])
        for name in PROMPT_FIELDS:
            picked[name] = picked[name][:, picked[name].shape[1] - P:]
        for name in RESPONSE_FIELDS:
            if name in picked:
                picked[name] = picked[name][:, :R]
        return replace(self, **picked)

    def groups(self, index) -> "Batch":
        """Whole groups: index is a (num_groups,) bool mask or a tensor of group numbers."""
        index = torch.as_tensor(index)
        if index.dtype == torch.bool:
            index = index.nonzero().flatten()
        index = index.to(self.prompt_ids.device)
        offsets = torch.arange(self.group_size, device=index.device)
        return self.rows((index[:, None] * self.group_size + offsets).flatten())

    def to(self, device) -> "Batch":
        return replace(self, **{name: t.to(device) for name, t in self.tensors().items()})

    def split(self, rows_per_part: int) -> list["Batch"]:
        return [self.rows(slice(i, i + rows_per_part)) for i in range(0, len(self), rows_per_part)]

    def micro_batches(self, max_rows: int, max_tokens: int = 0) -> list["Batch"]:
        """The micro-batches of micro_batch_rows(), in step with the other ranks: under FSDP
        every forward and backward is a collective, so a rank with fewer micro-batches than
        another runs as many, the extra ones fillers that train nothing (masked_first_row())."""
        parts = [self.rows(index) for index in self.micro_batch_rows(max_rows, max_tokens)]
        return _in_step_with_every_rank(parts)

    def masked_first_row(self) -> "Batch":
        """Its first row with no response token: it goes through the model, and weighs nothing in
        a loss or a metric (both sum over the response mask)."""
        row = self.rows(slice(0, 1))
        return replace(row, response_mask=torch.zeros_like(row.response_mask))

    def per_token(self, fn, max_rows: int, max_tokens: int = 0) -> list[torch.Tensor]:
        """fn(micro-batch) -> (b, r) tensors, run on each micro-batch in step with the other ranks
        and put back together as (N, R) tensors in this batch's row order, 0 on padding."""
        rows = self.micro_batch_rows(max_rows, max_tokens)
        micro_batches = _in_step_with_every_rank([self.rows(index) for index in rows])
        # The fillers come last, and zip() with the rows below stops before their results.
        results = [fn(micro) for micro in micro_batches]
        joined = [t.new_zeros(self.response_ids.shape) for t in results[0]]  # (N, R) each
        for index, micro, parts in zip(rows, micro_batches, results):
            for whole, part in zip(joined, parts):
                whole[index, :part.shape[1]] = part.masked_fill(~micro.response_mask, 0.0)
        return joined

    def micro_batch_rows(self, max_rows: int, max_tokens: int = 0) -> list[torch.Tensor]:
        """Row indices of each micro-batch: max_rows rows at a time or, with max_tokens, rows
        sorted by length and packed while the micro-batch's padded size (rows x (longest prompt +
        longest response)) stays within max_tokens, which bounds padding and memory. A longer row
        goes alone."""
        if not max_tokens:
            return [torch.arange(i, min(i + max_rows, len(self)), device=self.prompt_ids.device)
                    for i in range(0, len(self), max_rows)]
        prompt_len, response_len = self.prompt_mask.sum(-1), self.response_lengths  # (N,)
        order = (prompt_len + response_len).argsort(descending=True, stable=True).tolist()
        parts, current, widest_prompt, widest_response = [], [], 0, 0
        for i in order:
            p = max(widest_prompt, int(prompt_len[i]))
            r = max(widest_response, int(response_len[i]))
            if current and (len(current) + 1) * (p + r) > max_tokens:
                parts.append(current)
                current, p, r = [], int(prompt_len[i]), int(response_len[i])
            current.append(i)
            widest_prompt, widest_response = p, r
        parts.append(current)
        return [torch.tensor(rows, device=self.prompt_ids.device) for rows in parts]

    @staticmethod
    def cat(batches: list["Batch"]) -> "Batch":
        """One batch from several, prompts re-padded on the left and responses on the right."""
        P = max(b.prompt_ids.shape[1] for b in batches)
        R = max(b.response_ids.shape[1] for b in batches)
        joined = {}
        for name in batches[0].tensors():
            parts = [getattr(b, name) for b in batches]
            if name in PROMPT_FIELDS:
                parts = [F.pad(t, (P - t.shape[1], 0)) for t in parts]
            elif name in RESPONSE_FIELDS:
                parts = [F.pad(t, (0, R - t.shape[1])) for t in parts]
            joined[name] = torch.cat(parts)
        return replace(batches[0], **joined)


def _in_step_with_every_rank(parts: list[Batch]) -> list[Batch]:
    """parts, then as many fillers (the first part's masked_first_row()) as this rank has fewer
    parts than the rank with the most."""
    most = int(distributed.all_reduce(len(parts), "max", name="micro-batch count"))
    return parts + [parts[0].masked_first_row()] * (most - len(parts))


@dataclass
class Collected:
    """What dapo.collect_batch hands the update and the log."""
    to_train: Batch | None  # this rank's share of the training batch; None when nothing was kept
    generated: Batch  # every response this rank generated, kept or not: what the alarms quote
    metrics: dict  # the rollout's and dynamic sampling's, over all ranks
    gen_s: float  # seconds spent sampling, scoring and filtering (timing/gen_s)


# --------------------------------------------------------------------------------------------------
# Dynamic sampling's buffer (Algorithm 1, lines 6-8)

class GroupBuffer:
    """The groups with signal, whole, added generation batch after generation batch until the
    buffer holds `capacity` over all ranks. Rank r samples prompts r, r + W, r + 2W, ... of each
    generation batch; its groups are numbered in the order one process would have generated them,
    and take() shares out the first N, so that W ranks train on exactly what one process would."""

    def __init__(self, capacity: int, max_gen_batches: int = 0):
        self.capacity, self.max_gen_batches = capacity, max_gen_batches
        self.kept: dict[int, Batch] = {}  # this rank's groups with signal, by global number
        self.n_kept = 0  # the groups kept over all ranks, as of the last done()
        self.generated: list[Batch] = []  # this rank's generation batches, every group of them
        self.end_times: list[float] = []  # when each was added
        self.started = time.time()

    def done(self) -> bool:
        """Whether dynamic sampling stops: the buffer holds its capacity over all ranks, or
        max_gen_batches generation batches were added (0: no cap). A collective: every rank calls
        it. health says so when the search runs long, and stops one that finds no group at all."""
        self.n_kept = distributed.all_reduce(len(self.kept), name="dynamic-sampling count")
        if self.n_kept >= self.capacity:
            return True
        health.check_sampling(len(self.generated), self.n_kept, self.capacity)
        return bool(self.max_gen_batches) and len(self.generated) == self.max_gen_batches

    def add(self, batch: Batch, keep: torch.Tensor, prompts_per_gen: int):
        """The groups that keep (num_groups,) bool marks, of this rank's share of a generation
        batch of prompts_per_gen prompts."""
        first = len(self.generated) * prompts_per_gen
        world, rank = distributed.world_size(), distributed.rank()
        for i in keep.nonzero().flatten().tolist():
            self.kept[first + i * world + rank] = batch.groups([i])
        self.generated.append(batch)
        self.end_times.append(time.time())

    def take(self, n_groups: int, mini_batch_prompts: int, group_size: int) -> Batch | None:
        """This rank's share of the responses of the first n_groups groups kept over all ranks,
        each optimizer step's split evenly between the ranks: whole groups when each rank's share
        of a step is whole groups, else single responses (the paper's 32 prompts per step on 128
        ranks). None when n_groups is 0."""
        if not n_groups:
            return None
        if mini_batch_prompts % distributed.world_size() == 0:  # whole groups fit each share
            return Batch.cat(distributed.share_in_order(self.kept, n_groups, mini_batch_prompts))
        responses = {g * group_size + i: row for g, group in self.kept.items()
                     for i, row in enumerate(group.split(1))}
        return Batch.cat(distributed.share_in_order(responses, n_groups * group_size,
                                                    mini_batch_prompts * group_size))


def groups_to_train(n_kept: int, cfg) -> int:
    """How many kept groups to train on: all of --train-prompts or, when dynamic sampling stopped
    at --max-gen-batches short of them, the whole mini-batches kept (a partial one would take a full
    optimizer step), or with --on-gen-cap error verl's error."""
    if n_kept >= cfg.train_prompts:
        return cfg.train_prompts
    if cfg.on_gen_cap == "error":
        raise UserError(f"dynamic sampling found {n_kept} of {cfg.train_prompts} groups with "
                        f"signal in --max-gen-batches {cfg.max_gen_batches} generation batches: "
                        "raise the cap (0 = none), or train on them with --on-gen-cap train")
    return n_kept - n_kept % cfg.mini_batch_prompts
