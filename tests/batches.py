"""Batches built by hand for the update's tests (test_dapo.py, dist_worker.py)."""
from dataclasses import replace

import torch

from batch import Batch


def random_batch(vocab, n=8, group_size=4, seed=0, dtype=torch.float32) -> Batch:
    """n responses of 1-8 tokens to prompts of 3-6 tokens, random advantages, pi_old and sampler
    log-probs (in dtype: float64 for the exact comparisons); response 3 is truncated."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g)
               for _ in range(n)]
    responses = [torch.randint(1, vocab, (int(torch.randint(1, 9, (1,), generator=g)),),
                               generator=g) for _ in range(n)]
    P, R = max(map(len, prompts)), max(map(len, responses))
    batch = Batch(prompt_ids=torch.zeros(n, P, dtype=torch.long),
                  prompt_mask=torch.zeros(n, P, dtype=torch.bool),
                  response_ids=torch.zeros(n, R, dtype=torch.long),
                  response_mask=torch.zeros(n, R, dtype=torch.bool),
                  score=torch.zeros(n), acc=torch.zeros(n, dtype=torch.bool),
                  truncated=torch.arange(n) == 3, group_size=group_size,
                  adv=torch.randn(n, generator=g), old_logp=torch.zeros(n, R))
    for i, (p, r) in enumerate(zip(prompts, responses)):
        batch.prompt_ids[i, P - len(p):], batch.prompt_mask[i, P - len(p):] = p, True
        batch.response_ids[i, :len(r)], batch.response_mask[i, :len(r)] = r, True
        batch.old_logp[i, :len(r)] = torch.randn(len(r), generator=g) * 0.1 - 4.0
    # drawn apart, so that the other fields stay what they were before the sampler's were added
    rollout_logp = torch.randn(n, R, generator=torch.Generator().manual_seed(seed + 1)) - 4.0
    return replace(batch, adv=batch.adv.to(dtype), old_logp=batch.old_logp.to(dtype),
                   rollout_logp=(rollout_logp * batch.response_mask).to(dtype))


def scripted_rollout(model, rows, tok, cfg, verifier, *, group_size, **sampling) -> Batch:
    """A stand-in for dapo.rollout whose responses depend on the row alone, the same in every
    process: row k's prompt is [k + 3], and its group is all right (k % 4 == 0), all wrong
    (k % 4 == 1) or right once (otherwise)."""
    index = torch.tensor([row["extra_info"]["index"] for row in rows for _ in range(group_size)])
    first = (torch.arange(len(index)) % group_size) == 0  # the first response of its group
    acc = (index % 4 == 0) | ((index % 4 > 1) & first)
    n = len(index)
    return Batch(prompt_ids=(index + 3)[:, None], prompt_mask=torch.ones(n, 1, dtype=torch.bool),
                 response_ids=torch.tensor([[7, 8, 9]] * n),
                 response_mask=torch.ones(n, 3, dtype=torch.bool), score=acc.float() * 2 - 1,
                 acc=acc, truncated=torch.zeros(n, dtype=torch.bool), group_size=group_size)


def indexed_rows(n):
    """n rows that scripted_rollout tells apart by their extra_info index."""
    return [{"data_source": "toy_sum", "prompt": [{"role": "user", "content": f"{k}"}],
             "reward_model": {"ground_truth": "0"}, "extra_info": {"index": k}} for k in range(n)]
