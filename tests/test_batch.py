"""batch.py: the typed batch's operations (rows, groups, split, micro-batches, per_token, cat) and
dynamic sampling's buffer (GroupBuffer, groups_to_train), in one process. What N ranks make of
them, against one process: test_dapo.py (collect_batch) and test_distributed.py (the update)."""
from dataclasses import replace

import pytest
import torch

from batch import Batch, GroupBuffer, groups_to_train
from batches import random_batch
from config import Config
from infra import distributed
from infra.errors import UserError


def numbered(batch: Batch) -> Batch:
    """batch with each row's number as its score, so that a row can be told wherever it goes."""
    return replace(batch, score=torch.arange(len(batch), dtype=torch.float32))


def other_rank_has_more(monkeypatch, more: int):
    """The all-reduce of the micro-batch count, as if another rank had `more` micro-batches."""
    monkeypatch.setattr(distributed, "all_reduce", lambda n, op="sum", name=None: n + more)


# --- the batch's operations ---

def test_rows_keep_the_rows_asked_for_and_trim_the_padding_none_of_them_uses():
    batch = numbered(random_batch(50, n=8))  # prompts of 3-6 tokens, responses of 1-8
    index = torch.tensor([5, 0])  # prompts of 4 and 3 tokens, responses of 2 and 4
    picked = batch.rows(index)
    assert picked.score.tolist() == [5, 0] and picked.group_size == batch.group_size
    assert picked.prompt_ids.shape == picked.prompt_mask.shape == (2, 4)
    assert picked.response_ids.shape == picked.old_logp.shape == picked.rollout_logp.shape == (2, 4)
    # a prompt ends at the last column (left padding), a response starts at the first (right)
    assert torch.equal(picked.prompt_ids, batch.prompt_ids[index, -4:])
    assert torch.equal(picked.response_ids, batch.response_ids[index, :4])
    assert torch.equal(picked.old_logp, batch.old_logp[index, :4])


def test_groups_take_whole_groups_by_mask_or_by_number():
    batch = numbered(random_batch(50, n=12, group_size=3))  # 4 groups of 3
    assert batch.groups(torch.tensor([False, True, False, True])).score.tolist() == \
        [3, 4, 5, 9, 10, 11]
    assert batch.groups(torch.tensor([3, 1])).score.tolist() == [9, 10, 11, 3, 4, 5]


def test_split_cuts_the_rows_in_order():
    batch = numbered(random_batch(50, n=8))
    assert [part.score.tolist() for part in batch.split(3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_micro_batches_by_count_take_max_rows_in_order():
    batch = random_batch(50, n=8)
    assert [rows.tolist() for rows in batch.micro_batch_rows(max_rows=3)] == \
        [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_micro_batches_by_tokens_pack_sorted_rows_under_the_budget():
    batch = random_batch(50, n=8)
    widths = batch.prompt_mask.sum(-1), batch.response_mask.sum(-1)
    parts = batch.micro_batch_rows(max_rows=64, max_tokens=30)
    rows = sorted(i for part in parts for i in part.tolist())
    assert rows == list(range(8))
    for part in parts:
        padded = len(part) * (widths[0][part].max() + widths[1][part].max())
        assert padded <= 30 or len(part) == 1


def test_in_one_process_the_micro_batches_are_the_rows_of_micro_batch_rows():
    batch = numbered(random_batch(50, n=8))
    for max_tokens in (0, 30):
        rows = batch.micro_batch_rows(max_rows=3, max_tokens=max_tokens)
        parts = batch.micro_batches(max_rows=3, max_tokens=max_tokens)
        assert [part.score.tolist() for part in parts] == [r.tolist() for r in rows]


def test_the_masked_first_row_is_the_first_row_without_a_response_token():
    batch = random_batch(50, n=8)
    first, filler = batch.rows(slice(0, 1)), batch.masked_first_row()
    assert torch.equal(filler.prompt_ids, first.prompt_ids)
    assert torch.equal(filler.response_ids, first.response_ids)  # what the forward reads
    assert filler.response_mask.shape == first.response_mask.shape
    assert not filler.response_mask.any()  # what a loss and a metric sum over


def test_a_rank_with_fewer_micro_batches_runs_fillers_after_its_own(monkeypatch):
    # under FSDP each forward is a collective: every rank runs as many as the rank with the most
    other_rank_has_more(monkeypatch, 2)
    batch = numbered(random_batch(50, n=8))
    parts = batch.micro_batches(max_rows=3)
    assert [part.score.tolist() for part in parts[:3]] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert len(parts) == 5
    assert all(len(part) == 1 and not part.response_mask.any() for part in parts[3:])


def test_per_token_puts_each_micro_batchs_results_back_in_the_batchs_row_order(monkeypatch):
    other_rank_has_more(monkeypatch, 1)  # a filler runs too; its results are dropped
    batch = random_batch(50, n=8, dtype=torch.float64)
    packed = [i for rows in batch.micro_batch_rows(64, max_tokens=30) for i in rows.tolist()]
    assert packed != list(range(8))  # longest first: not the batch's order
    calls = []

    def token_ids_and_old_logp(micro):  # (b, r) each
        calls.append(len(micro))
        return micro.response_ids.double(), micro.old_logp

    ids, old_logp = batch.per_token(token_ids_and_old_logp, max_rows=64, max_tokens=30)
    assert torch.equal(ids, (batch.response_ids * batch.response_mask).double())
    assert torch.equal(old_logp, batch.old_logp * batch.response_mask)
    assert sum(calls) == len(batch) + 1


def test_cat_pads_prompts_on_the_left_and_responses_on_the_right():
    batch = random_batch(50, n=8)
    order = [0, 5, 1, 2, 3, 4, 6, 7]
    narrow = batch.rows(order[:2])  # prompts of 3-4 tokens, responses of 2-4: trimmed
    assert narrow.prompt_ids.shape[1] < batch.prompt_ids.shape[1]
    assert narrow.response_ids.shape[1] < batch.response_ids.shape[1]
    joined, expected = Batch.cat([narrow, batch.rows(order[2:])]), batch.rows(order)
    assert joined.tensors().keys() == expected.tensors().keys()
    for name, t in expected.tensors().items():
        assert torch.equal(getattr(joined, name), t), name


# --- dynamic sampling's buffer (Algorithm 1, lines 6-8) ---

def generation(first_prompt: int, prompts: int = 4, group_size: int = 2) -> Batch:
    """A generation batch whose responses score the number of their prompt, counted from
    first_prompt across generation batches."""
    batch = random_batch(50, n=prompts * group_size, group_size=group_size, seed=first_prompt)
    return replace(batch, score=(first_prompt + torch.arange(len(batch)) // group_size).float())


def test_the_buffer_takes_the_first_groups_with_signal_in_the_order_they_were_generated():
    buffer = GroupBuffer(capacity=3)
    buffer.add(generation(0), keep=torch.tensor([True, False, False, True]), prompts_per_gen=4)
    assert not buffer.done() and buffer.n_kept == 2
    buffer.add(generation(4), keep=torch.tensor([False, True, True, False]), prompts_per_gen=4)
    assert buffer.done() and buffer.n_kept == 4
    taken = buffer.take(3, mini_batch_prompts=1, group_size=2)
    assert taken.score.tolist() == [0, 0, 3, 3, 5, 5]  # prompt 6's group is the surplus
    assert len(buffer.generated) == 2  # every generation batch, for the metrics


def test_the_buffer_is_done_after_max_gen_batches_short_of_its_capacity():
    buffer = GroupBuffer(capacity=4, max_gen_batches=2)
    for first_prompt in (0, 4):
        assert not buffer.done()
        buffer.add(generation(first_prompt), keep=torch.tensor([False, False, True, False]),
                   prompts_per_gen=4)
    assert buffer.done() and buffer.n_kept == 2
    assert buffer.take(0, mini_batch_prompts=1, group_size=2) is None


@pytest.mark.parametrize("n_kept,trained", [(40, 32), (32, 32), (20, 16), (7, 0)])
def test_groups_to_train_are_train_prompts_or_the_whole_mini_batches_kept(n_kept, trained):
    # a partial mini-batch would take a whole optimizer step: left out at the cap
    assert groups_to_train(n_kept, Config(train_prompts=32, mini_batch_prompts=8)) == trained


def test_groups_to_train_short_of_train_prompts_stop_with_on_gen_cap_error():
    cfg = Config(train_prompts=32, mini_batch_prompts=8, max_gen_batches=4, on_gen_cap="error")
    assert groups_to_train(32, cfg) == 32
    with pytest.raises(UserError, match="found 20 of 32 groups with signal in --max-gen-batches "
                                        "4 generation batches"):
        groups_to_train(20, cfg)
