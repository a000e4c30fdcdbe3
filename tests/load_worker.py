r"""Run by tests/test_launch.py under `torchrun --nproc_per_node=2`: launch.load_sharded, the
policy loaded shard by shard, with this rank's peak memory during the load and the full weights
it gathers to. The peak is of anonymous memory (RssAnon, sampled every millisecond): the
file pages a memory-mapped read touches are page cache, which the kernel takes back at need.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/load_worker.py \
        MODEL_DIR OUT_DIR
"""
import json
import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import launch  # noqa: E402
from config import Config  # noqa: E402
from infra import distributed  # noqa: E402
from model import Transformer, preset  # noqa: E402


def resident_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field)).split()[1])


def main(model_dir, out_dir):
    distributed.init("cpu")
    torch.set_num_threads(1)
    with torch.device("meta"):  # torch's first model there sets up ~70 MB of its own, once
        Transformer(preset("tiny", vocab_size=8))
    before, peak, done = resident_kb("RssAnon"), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], resident_kb("RssAnon") - before)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    model = launch.load_sharded(model_dir, Config(precision="fp32"))
    done.set()
    sampler.join()
    weights = distributed.full_state_dict(model)
    if distributed.rank() == 0:
        torch.save(weights, os.path.join(out_dir, "weights.pt"))
    with open(os.path.join(out_dir, f"rank{distributed.rank()}.json"), "w") as f:
        json.dump({"peak_kb": peak[0]}, f)
    distributed.shutdown()
    distributed.exit_after_shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
