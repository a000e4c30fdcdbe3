r"""Run by tests/test_distributed.py under `torchrun --nproc_per_node=2`: DAPO updates on
FSDP2-sharded ranks, in float64 (so that 2 ranks and 1 process, which sum the same gradients in
another order, differ by float64 round-off only), one per run named, each from the same weights
into OUT_DIR/RUN/ (one torchrun start for all: each costs seconds).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/dist_worker.py \
        MODEL_DIR OUT_DIR RUN [RUN ...]     # RUN: sgd, adamw, sgd-tokens, sgd-rows, NEIGHBOURS'
"""
import json
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from infra import checkpoint  # noqa: E402
from infra import distributed  # noqa: E402
from dapo import Config, advantages, update_policy  # noqa: E402
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
    lengths (batches.random_batch), in float64, with random advantages and random rewards."""
    batch = random_batch(vocab, n=n_groups * GROUP, group_size=GROUP, seed=seed,
                         dtype=torch.float64)
    rewards = torch.randn(len(batch), generator=torch.Generator().manual_seed(seed + 2),
                          dtype=torch.float64)
    return replace(batch, reward=rewards)


def with_advantages(batch, cfg) -> Batch:
    """With --scale-rewards batch or none, the advantages of the batch's rewards, made as
    collect_batch makes them: of whole groups, each rank its own, the batch std every rank's
    (losses.batch_std); with group, the batch's random ones."""
    if cfg.scale_rewards == "group":
        return batch
    return replace(batch, adv=advantages(batch.reward, cfg))


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


# DAPO's neighbours (losses.py) on the "sgd" run: what each asks the 2 ranks to agree on
NEIGHBOURS = {
    # one ratio per response, in its paper's aggregation; at 0.02 its clip binds on a few
    "sgd-gspo": dict(loss_mode="gspo", loss_agg_mode="seq-mean-token-mean", eps_low=0.02,
                     eps_high=0.02),
    "sgd-cispo": dict(loss_mode="cispo"),  # a detached clipped weight on every token's log-prob
    # Dr. GRPO: sums over the constant --max-response-len and advantages without the std; by
    # token budget, the ranks' micro-batches have other padded widths than one process's
    "sgd-dr-grpo": dict(loss_agg_mode="seq-mean-token-sum-norm", scale_rewards="none",
                        micro_batch_tokens=20),
    "sgd-batch-std": dict(scale_rewards="batch"),  # the std of every rank's rewards
}


def run_config(name):
    """"...-tokens": micro-batches by token budget, which gives the ranks different numbers, and
    the loss weighed by the rollout correction; "...-rows": one prompt per optimizer step, whose
    responses the 2 ranks split; NEIGHBOURS' their flags."""
    if name in NEIGHBOURS:
        return replace(CFG, **NEIGHBOURS[name])
    if name.endswith("-rows"):
        return replace(CFG, mini_batch_prompts=1)
    return replace(CFG, micro_batch_tokens=20, **CORRECTED) if name.endswith("-tokens") else CFG


def update_on_ranks(model_dir, out_dir, name, vocab, rank, world):
    """Run `name`'s update on this rank's share of the batch; rank 0 saves the weights, the
    metrics and the logits of PROBE, every rank the checkpoint and its micro-batch counts."""
    os.makedirs(out_dir, exist_ok=True)
    model = distributed.shard(load_model(model_dir), mixed_precision=False)
    opt = make_optimizer(name, model.parameters())
    cfg = run_config(name)
    mine = with_advantages(my_share(make_batch(vocab), rank, world, cfg), cfg)
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


def main(model_dir, out_dir, *names):
    rank, world, _ = distributed.init("cpu")
    torch.set_num_threads(1)
    vocab = load_tokenizer(model_dir).vocab_size
    for name in names:
        update_on_ranks(model_dir, os.path.join(out_dir, name), name, vocab, rank, world)
    distributed.shutdown()
    distributed.exit_after_shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
