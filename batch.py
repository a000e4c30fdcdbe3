"""
The batch of a rollout step: every response to every prompt, as tensors, in one typed record.

rollout() in dapo.py makes one from the sampler's output and the verifier's scores; the loop then
adds the shaped reward, the group advantage and pi_old's log-probs with dataclasses.replace, so a
function's signature says which fields it reads. The three operations the loop needs:

    batch.groups(keep)      whole groups (dynamic sampling keeps or drops a prompt's G responses)
    batch.rows(slice)       mini-batches and micro-batches, their padding trimmed
    Batch.cat([...])        generation batches accumulated until the training batch is full

Layout of row i (P = longest prompt, R = longest response of the batch):

    prompt_ids[i]:   pad pad p0 p1 p2        left-padded, so every prompt ends at column P
    response_ids[i]: r0  r1  r2 EOS pad pad  right-padded, so every response starts at column 0
"""
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F


def _longest(mask) -> int:
    return int(mask.sum(-1).max()) if len(mask) else 0


PROMPT_FIELDS = ("prompt_ids", "prompt_mask")  # left-padded: the real tokens end at column P
RESPONSE_FIELDS = ("response_ids", "response_mask", "old_logp")  # right-padded: start at column 0


@dataclass
class Batch:
    """G responses to each prompt, group after group: rows [i G, (i + 1) G) answer prompt i.
    rollout() makes one; the loop adds the reward, the advantage and pi_old's log-probs with
    dataclasses.replace, so which fields a function needs is visible in its signature."""
    prompt_ids: torch.Tensor  # (N, P) long, left-padded
    prompt_mask: torch.Tensor  # (N, P) bool: True on prompt tokens
    response_ids: torch.Tensor  # (N, R) long, right-padded
    response_mask: torch.Tensor  # (N, R) bool: True on response tokens, the EOS included
    score: torch.Tensor  # (N,) fp32: the verifier's +1 (right) or -1 (wrong)
    acc: torch.Tensor  # (N,) bool: the answer is right
    truncated: torch.Tensor  # (N,) bool: cut at max_response_len before any EOS
    group_size: int
    reward: torch.Tensor | None = None  # (N,) fp32: score + overlong penalty (technique 4)
    adv: torch.Tensor | None = None  # (N,) fp32: the group advantage (Eq. 9)
    old_logp: torch.Tensor | None = None  # (N, R) fp32: log pi_old of each response token

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
        out = {name: t[index] for name, t in self.tensors().items()}
        P, R = _longest(out["prompt_mask"]), _longest(out["response_mask"])
        for name in PROMPT_FIELDS:
            out[name] = out[name][:, out[name].shape[1] - P:]
        for name in RESPONSE_FIELDS:
            if name in out:
                out[name] = out[name][:, :R]
        return replace(self, **out)

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

    @staticmethod
    def cat(batches: list["Batch"]) -> "Batch":
        """One batch from several, prompts re-padded on the left and responses on the right."""
        P = max(b.prompt_ids.shape[1] for b in batches)
        R = max(b.response_ids.shape[1] for b in batches)
        out = {}
        for name in batches[0].tensors():
            parts = [getattr(b, name) for b in batches]
            if name in PROMPT_FIELDS:
                parts = [F.pad(t, (P - t.shape[1], 0)) for t in parts]
            elif name in RESPONSE_FIELDS:
                parts = [F.pad(t, (0, R - t.shape[1])) for t in parts]
            out[name] = torch.cat(parts)
        return replace(batches[0], **out)
