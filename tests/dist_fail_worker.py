"""Run by tests/test_distributed.py and tests/test_launch.py as two plain processes (RANK and
WORLD_SIZE set by the test, which also holds the store they meet on; no torchrun: the test itself
stops and kills them). Each mode is one way a rank can go wrong.

    stop  rank 1 stops itself (SIGSTOP, as a debugger or a swapping node would); rank 0 waits in a
          named all-reduce
    resume  both resume from OUT_DIR's latest checkpoint, which lacks rank 1's trainer state
            (rank 1 would raise in loading it while rank 0 waits in the next collective)
    nan   rank 1's shard of one FSDP2-sharded parameter gets a NaN; both ranks run check_finite
    dead  in launch.session, as dapo.py runs: rank 1 dies (os._exit) while rank 0 waits in a named
          all-reduce; rank 0's error must be the last thing it prints
    fsdp  in launch.session: rank 1 stops itself (SIGSTOP) while rank 0 runs an FSDP2 forward and
          backward, whose collectives no helper of ours names
    fsdp-dead  the same, rank 1 dying (os._exit) instead: rank 0 is gathering the weights
"""
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from infra import checkpoint  # noqa: E402
from infra import health  # noqa: E402
from infra import distributed  # noqa: E402
from infra.errors import UserError  # noqa: E402
from model import Transformer, preset  # noqa: E402

POISONED = "model.layers.1.mlp.down_proj.weight"


def main(mode, timeout_s, out_dir=None):
    if mode == "dead":
        import launch
        from config import Config
        with launch.session(Config(device="cpu", dist_timeout=float(timeout_s))) as cfg:
            die_on_rank_1(cfg)
        return
    if mode in ("fsdp", "fsdp-dead"):
        import launch
        from config import Config
        cfg = Config(device="cpu", dist_timeout=float(timeout_s), out_dir=out_dir)
        with launch.user_errors_in_one_line(), launch.session(cfg) as cfg:  # as dapo.py's
            stop_in_fsdp(cfg, dies=mode == "fsdp-dead")
        return
    rank, _, _ = distributed.init("cpu", timeout_s=float(timeout_s))
    torch.set_num_threads(1)
    if mode == "stop":
        if rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        distributed.all_reduce(1, name="dynamic-sampling count")
    elif mode == "resume":
        try:  # launch.session's shape: an error on one rank still reaches shutdown()
            ckpt = checkpoint.prepare_out_dir(out_dir, resume=True, overwrite=False)
            distributed.barrier("set-up")  # as sharding the model would
            # as checkpoint.load_trainer_state does
            torch.load(os.path.join(ckpt, f"trainer_rank{rank}.pt"), weights_only=True)
            distributed.all_reduce(1, name="first step")
        except UserError as e:
            print(f"rank {rank} raised: {e}", flush=True)
        finally:
            distributed.shutdown()
    elif mode == "nan":
        torch.manual_seed(0)
        model = distributed.shard(Transformer(preset("tiny", vocab_size=64)), mixed_precision=False)
        health.check_finite(model, "before")  # all finite: passes on both ranks
        if rank == 1:
            with torch.no_grad():
                dict(model.named_parameters())[POISONED].to_local()[0, 0] = float("nan")
        try:
            health.check_finite(model, "after step 3")
        except FloatingPointError as e:
            print(f"rank {rank} raised: {e}", flush=True)
        distributed.shutdown()


def die_on_rank_1(cfg):
    torch.set_num_threads(1)
    if distributed.rank() == 1:
        os._exit(3)  # as a rank killed by the OOM killer: no clean-up, no goodbye
    distributed.all_reduce(1, name="dynamic-sampling count")


def stop_in_fsdp(cfg, dies=False):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = distributed.shard(Transformer(preset("tiny", vocab_size=64)), mixed_precision=False)
    if distributed.rank() == 1:
        if dies:
            os._exit(3)  # as a rank killed -9 or by the OOM killer
        os.kill(os.getpid(), signal.SIGSTOP)
    model(torch.randint(0, 64, (2, 8))).sum().backward()


if __name__ == "__main__":
    main(*sys.argv[1:])
