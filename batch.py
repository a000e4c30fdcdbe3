"""
The batch of a rollout step: every response to every prompt, as tensors, in one typed record.

rollout() in dapo.py makes one from the sampler's output and the verifier's scores; the loop then
adds the shaped reward, the group advantage and pi_old's log-probs with dataclasses.replace, so a
function's signature says which fields it reads. The three operations the loop needs:

    batch.groups(keep)      whole groups (dynamic sampling keeps or drops a prompt's G responses)
    batch.rows(slice)       mini-batches and micro-batches, their padding trimmed
    Batch.cat([...])        generation batches accumulated until the training batch is full
    batch.micro_batches()   the rows of each micro-batch, by count or by a budget of tokens

and dynamic sampling's buffer across processes: group_number(), groups_to_train(), share_groups().

Layout of row i (P = longest prompt, R = longest response of the batch):

    prompt_ids[i]:   pad pad p0 p1 p2        left-padded, so every prompt ends at column P
    response_ids[i]: r0  r1  r2 EOS pad pad  right-padded, so every response starts at column 0
"""
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F

from infra import distributed
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
    def from_rollout(cls, rollout, scores, group_size: int) -> "Batch":
        """From the sampler's Rollout and the verifier's reward.Scores of each response."""
        device = rollout.response_ids.device
        reward_error = None
        if scores.reward_error is not None:
            reward_error = torch.tensor(scores.reward_error, dtype=torch.bool, device=device)
        return cls(prompt_ids=rollout.prompt_ids, prompt_mask=rollout.prompt_mask,
                   response_ids=rollout.response_ids, response_mask=rollout.response_mask,
                   score=torch.tensor(scores.score, device=device),
                   acc=torch.tensor(scores.acc, dtype=torch.bool, device=device),
                   truncated=rollout.truncated, group_size=group_size,
                   rollout_logp=rollout.logprobs,
                   no_answer=torch.tensor(scores.no_answer, dtype=torch.bool, device=device),
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

    def micro_batches(self, max_rows: int, max_tokens: int = 0) -> list[torch.Tensor]:
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


# --------------------------------------------------------------------------------------------------
# Dynamic sampling's buffer over several processes (Algorithm 1, lines 6-8): the groups each rank
# kept are numbered in the order one process would have generated them and the first N shared
# out, so the ranks train on exactly the responses one process would

def group_number(n_gen: int, prompts_per_gen: int, i: int) -> int:
    """The global number of this rank's i-th group of its n_gen-th generation batch (rank r
    samples prompts r, r + W, r + 2W, ... of each generation batch)."""
    return n_gen * prompts_per_gen + i * distributed.world_size() + distributed.rank()


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


def share_groups(kept: dict[int, Batch], n_take: int, mini_batch_prompts: int,
                 group_size: int) -> Batch | None:
    """This rank's share of the responses of the first n_take groups kept over all ranks (kept:
    {global group number: its Batch of group_size responses}), each optimizer step's split evenly
    between the ranks: whole groups when each rank's share of a step is whole groups, else single
    responses (the paper's 32 prompts per step on 128 ranks). None when n_take is 0."""
    if not n_take:
        return None
    if mini_batch_prompts % distributed.world_size() == 0:  # whole groups fit each share
        return Batch.cat(distributed.share_in_order(kept, n_take, mini_batch_prompts))
    responses = {g * group_size + i: row for g, group in kept.items()
                 for i, row in enumerate(group.split(1))}
    return Batch.cat(distributed.share_in_order(responses, n_take * group_size,
                                                mini_batch_prompts * group_size))
