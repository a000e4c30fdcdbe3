"""batch.py: the typed batch's operations (rows, groups, split, micro-batches, per_token, cat) and
dynamic sampling's buffer (GroupBuffer, groups_to_train), in one process. What N ranks make of
them, against one process: test_dapo.py (collect_batch) and test_distributed.py (the update)."""
from batches import random_batch


def test_micro_batches_by_tokens_pack_sorted_rows_under_the_budget():
    batch = random_batch(50, n=8)
    widths = batch.prompt_mask.sum(-1), batch.response_mask.sum(-1)
    parts = batch.micro_batch_rows(max_rows=64, max_tokens=30)
    rows = sorted(i for part in parts for i in part.tolist())
    assert rows == list(range(8))
    for part in parts:
        padded = len(part) * (widths[0][part].max() + widths[1][part].max())
        assert padded <= 30 or len(part) == 1
