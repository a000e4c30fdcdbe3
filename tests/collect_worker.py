"""Run by tests/test_dapo.py, in one process or under `torchrun --nproc_per_node=2`: one step of
dynamic sampling (dapo.collect_batch) over scripted generations; writes which groups each rank
trains in each mini-batch.

    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        tests/collect_worker.py OUT [rows]
"""
import json
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dapo  # noqa: E402
from infra import distributed  # noqa: E402
from batches import indexed_rows, scripted_rollout  # noqa: E402
from data import PromptIterator  # noqa: E402
from reward import Verifier  # noqa: E402

CFG = dapo.Config(train_prompts=8, gen_prompts=6, group_size=2, mini_batch_prompts=4,
                  max_gen_batches=0, device="cpu")
ROWS = indexed_rows(60)


def position(k):
    """Where row k sat in its generation batch: rank r of 2 generates positions r, r + 2, ..."""
    order = PromptIterator(ROWS, CFG.gen_prompts, 0)._epoch_order(0).tolist()
    return order.index(k) % CFG.gen_prompts


def collect(cfg=CFG):
    """-> (the prompt number of each response this rank trains, per mini-batch; the step's
    metrics), with dapo.rollout replaced by scripted_rollout."""
    prompt_iter = PromptIterator(ROWS, cfg.gen_prompts, seed=0)
    collected = dapo.collect_batch(torch.nn.Linear(1, 1), prompt_iter, None, cfg, Verifier(), None)
    batch, metrics = collected.to_train, collected.metrics
    responses = (batch.prompt_ids[:, -1] - 3).tolist()
    share = cfg.mini_batch_prompts * cfg.group_size // distributed.world_size()
    return [responses[i:i + share] for i in range(0, len(responses), share)], metrics


if __name__ == "__main__":
    distributed.init("cpu")
    dapo.rollout = scripted_rollout
    # "rows": one prompt per mini-batch, so each rank trains one of each group's 2 responses
    mini_batches, metrics = collect(replace(CFG, mini_batch_prompts=1) if sys.argv[2:] == ["rows"]
                                    else CFG)
    with open(os.path.join(sys.argv[1], f"rank{distributed.rank()}.json"), "w") as f:
        json.dump({"mini_batches": mini_batches, "metrics": metrics}, f)
    distributed.shutdown()
    distributed.exit_after_shutdown()
