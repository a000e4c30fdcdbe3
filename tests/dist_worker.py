r"""Run by tests/test_distributed.py under `torchrun --nproc_per_node=2`: one DAPO update on
FSDP2-sharded ranks, in float64 (so that 2 ranks and 1 process, which sum the same gradients in
another order, differ by float64 round-off only).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/dist_worker.py \
        MODEL_DIR OUT_DIR sgd|adamw
"""
import json
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from infra import checkpoint  # noqa: E402
from infra import distributed  # noqa: E402
from dapo import Config, update_policy  # noqa: E402
from data import PromptIterator, load_tokenizer  # noqa: E402
from model import Transformer  # noqa: E402
from batch import Batch  # noqa: E402
from batches import random_batch  # noqa: E402

GROUP = 4
CFG = Config(group_size=GROUP, mini_batch_prompts=2, micro_batch_size=3, micro_batch_tokens=0,
             grad_clip=1e9, device="cpu")
PROBE = torch.arange(2 * 9).view(2, 9) % 50 + 3  # a fixed input whose logits the tests compare


def make_batch(vocab, n_groups=4, seed=0) -> Batch:
    """The same global batch on every process: n_groups groups of GROUP responses of varied
    lengths (batches.random_batch), in float64."""
    return random_batch(vocab, n=n_groups * GROUP, group_size=GROUP, seed=seed,
                        dtype=torch.float64)


def load_model(model_dir) -> Transformer:
    return Transformer.from_pretrained(model_dir, dtype=torch.float64)


def my_share(batch, rank, world, cfg=CFG):
    """Whole groups, every world-th one: rank r's i-th group is the global group i * world + r,
    so each local mini-batch holds this rank's part of the same global mini-batch. With fewer
    prompts in a mini-batch than ranks, the responses of each group are split between the ranks
    (rank r takes the r-th part of every group), as dapo.collect_batch does for 128 ranks."""
    if cfg.mini_batch_prompts % world == 0:
        return batch.groups(torch.arange(rank, batch.num_groups, world))
    part = GROUP // world
    return batch.rows(torch.tensor([g * GROUP + rank * part + i for g in range(batch.num_groups)
                                    for i in range(part)]))


def make_optimizer(name, params):
    return torch.optim.SGD(params, lr=1.0) if name.startswith("sgd") else \
        torch.optim.AdamW(params, lr=1e-3)


# "...-tokens" also weighs the loss by the rollout correction: its weights' sums over ranks too
CORRECTED = dict(rollout_correction="token_mask", rollout_is_min=0.5)


def run_config(name):
    """"...-tokens": micro-batches by token budget, which gives the ranks different numbers, and
    the loss weighed by the rollout correction; "...-rows": one prompt per optimizer step, whose
    responses the 2 ranks split."""
    if name.endswith("-rows"):
        return replace(CFG, mini_batch_prompts=1)
    return replace(CFG, micro_batch_tokens=20, **CORRECTED) if name.endswith("-tokens") else CFG


def main(model_dir, out_dir, opt_name):
    rank, world, _ = distributed.init("cpu")
    torch.set_num_threads(1)
    model = distributed.shard(load_model(model_dir), mixed_precision=False)
    tok = load_tokenizer(model_dir)
    opt = make_optimizer(opt_name, model.parameters())
    cfg = run_config(opt_name)
    mine = my_share(make_batch(tok.vocab_size), rank, world, cfg)
    real = [len(part.micro_batch_rows(cfg.micro_batch_size, cfg.micro_batch_tokens))
            for part in mine.split(cfg.mini_batch_prompts * GROUP // world)]
    with open(os.path.join(out_dir, f"micro_batches_rank{rank}.json"), "w") as f:
        json.dump(real, f)  # before the fillers: how many each rank needed
    metrics = update_policy(model, opt, mine, cfg)
    with torch.no_grad():
        logits = model(PROBE)
    weights = distributed.full_state_dict(model)
    if rank == 0:
        result = {"weights": weights, "metrics": metrics, "logits": logits}
        torch.save(result, os.path.join(out_dir, "result.pt"))
    checkpoint.save(out_dir, 1, model, model_dir, opt, PromptIterator([{"x": 1}], 1, 0),
                    torch.Generator(), {})
    distributed.shutdown()
    distributed.exit_after_shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
