"""Batches built by hand for the update's tests (test_dapo.py, dist_worker.py)."""
import torch

from batch import Batch


def random_batch(vocab, n=8, group_size=4, seed=0) -> Batch:
    """n responses of 1-8 tokens to prompts of 3-6 tokens, random advantages and pi_old log-probs;
    response 3 is truncated."""
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
    return batch
