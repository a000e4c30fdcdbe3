"""Two processes (gloo, FSDP2, `torchrun --nproc_per_node=2`) against one: the same update,
checkpoint and resume."""
import json
import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

from dapo import update_policy
from data import load_tokenizer
from dist_worker import (NEIGHBOURS, PROBE, load_model, make_batch, make_optimizer,
                         run_config, with_advantages)
from model import Transformer
from two_ranks import SMALL_RUN, first_ranks_output, start_pair, torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_process_update(model_dir, opt_name):
    """The same update in one process (micro-batches by count, whatever the 2 ranks used)."""
    model = load_model(model_dir)
    tok = load_tokenizer(model_dir)
    cfg = replace(run_config(opt_name), micro_batch_tokens=0)
    metrics = update_policy(model, make_optimizer(opt_name, model.parameters()),
                            with_advantages(make_batch(tok.vocab_size), cfg), cfg)
    return model, metrics


RUNS = ("sgd", "adamw", "sgd-tokens", "sgd-rows", *NEIGHBOURS)


@pytest.fixture(scope="module")
def two_rank_step(tiny_model_dir, tmp_path_factory):
    """One update on 2 FSDP ranks per run of dist_worker, all in one torchrun start (on 2 busy
    cores a start costs 10-20 s, a run 1-2 s): its directory (the checkpoint) and its weights,
    metrics and logits."""
    out = tmp_path_factory.mktemp("two")
    torchrun("tests/dist_worker.py", tiny_model_dir, str(out), *RUNS)
    return {name: (out / name, torch.load(out / name / "result.pt", weights_only=True))
            for name in RUNS}


# Both sides run in float64: they sum the same gradient terms in another order (2 ranks, then the
# reduction), so they differ by float64 round-off, ~1e-16 of the step with SGD. AdamW's first step
# is lr * g / (|g| + 1e-8): in a coordinate whose gradient cancels to nearly 0, a round-off of
# ~1e-17 becomes ~1e-9 of lr (measured: 4e-11 of the step). A bug (a per-rank denominator, a
# missing `* world`, a stand-in micro-batch that trains) moves weights by a good part of the step.
@pytest.mark.parity
@pytest.mark.parametrize("opt_name,tol", [
    ("sgd", 1e-9),
    ("adamw", 1e-7),
    # micro-batches by token budget on 2 ranks, against fixed-size ones in one process; the loss
    # weighed by --rollout-correction token_mask (dist_worker.CORRECTED)
    ("sgd-tokens", 1e-9),
    # one prompt per optimizer step: each rank trains half of each group's responses (what lets
    # the paper's 32-prompt mini-batch run on 128 ranks)
    ("sgd-rows", 1e-9),
    # DAPO's neighbours (dist_worker.NEIGHBOURS): GSPO, CISPO, Dr. GRPO (its constant length and
    # its advantages without the std), and TRL's batch std, of every rank's rewards; SGD, so
    # float64 round-off (measured: 5e-16 to 4e-15 of the step)
    *[(name, 1e-12) for name in NEIGHBOURS],
])
@pytest.mark.needs("policy_loss", "token_count", "logprobs_forward", "logprobs_backward", "rope",
                   "attention")
def test_two_ranks_take_the_same_step_as_one(tiny_model_dir, two_rank_step, opt_name, tol):
    _, two = two_rank_step[opt_name]
    one, metrics = one_process_update(tiny_model_dir, opt_name)
    worst = max((one.state_dict()[k] - v).abs().max().item() for k, v in two["weights"].items())
    moved = max((one.state_dict()[k] - v).abs().max().item()
                for k, v in load_model(tiny_model_dir).state_dict().items())
    print(f"{opt_name}: max |2-rank - 1-rank| = {worst:.2e}, {worst / moved:.1e} of the step "
          f"(which moved weights by up to {moved:.2e})")
    assert all(v.dtype == torch.float64 for v in two["weights"].values())
    assert worst < tol * moved and moved > 1e-4
    steps = 4 if opt_name.endswith("-rows") else 2  # 4 groups, in mini-batches of 1 or 2 prompts
    assert two["metrics"]["train/updates"] == metrics["train/updates"] == steps
    assert two["metrics"]["actor/pg_loss"] == pytest.approx(metrics["actor/pg_loss"], rel=1e-12)
    parity = [k for k in metrics if k.startswith("training/rollout_")]  # summed over ranks too
    assert len(parity) == 6 and all(two["metrics"][k] == pytest.approx(metrics[k], rel=1e-12)
                                    for k in parity), (parity, two["metrics"])
    corr = [k for k in metrics if k.startswith("rollout_corr/")]  # and the rollout correction's
    assert len(corr) == (13 if opt_name.endswith("-tokens") else 6)
    assert all(two["metrics"][k] == pytest.approx(metrics[k], rel=1e-12) for k in corr), \
        [(k, two["metrics"][k], metrics[k]) for k in corr]


@pytest.mark.parity
@pytest.mark.needs("policy_loss", "token_count", "logprobs_forward", "logprobs_backward", "rope",
                   "attention")
def test_ranks_needing_fewer_micro_batches_by_tokens_still_match(two_rank_step):
    out, _ = two_rank_step["sgd-tokens"]  # ...so the stand-in micro-batches were exercised
    counts = [json.loads((out / f"micro_batches_rank{r}.json").read_text()) for r in (0, 1)]
    assert counts[0] != counts[1]


@pytest.mark.parity
@pytest.mark.needs("policy_loss", "token_count", "logprobs_forward", "logprobs_backward", "rope",
                   "attention")
def test_two_rank_checkpoint_loads_in_one_process_with_identical_logits(two_rank_step):
    out, two = two_rank_step["adamw"]
    ckpt = out / "checkpoints" / "step_000001"
    assert (sorted(p for p in os.listdir(ckpt) if p.endswith(".pt"))
            == ["trainer_rank0.pt", "trainer_rank1.pt"])
    model = Transformer.from_pretrained(str(ckpt / "model"))
    saved = model.state_dict()  # the checkpoint holds exactly the weights the ranks trained...
    assert all(torch.equal(saved[k], w) for k, w in two["weights"].items())
    with torch.no_grad():  # ...and gives their logits, up to the order of a float64 matmul's sums
        # (FSDP2's gathered weights may take another BLAS path: bitwise only on some CPUs)
        torch.testing.assert_close(model(PROBE), two["logits"], rtol=1e-12, atol=1e-12)


@pytest.mark.needs("all")
def test_two_rank_run_resumes_exactly(tiny_model_dir, tmp_path):
    args = ["dapo.py", "--model", tiny_model_dir, *SMALL_RUN]
    torchrun(*args, "--out-dir", str(tmp_path / "straight"), "--steps", "3")
    torchrun(*args, "--out-dir", str(tmp_path / "resumed"), "--steps", "2")
    torchrun(*args, "--out-dir", str(tmp_path / "resumed"), "--steps", "3", "--resume")
    step_3 = os.path.join("checkpoints", "step_000003", "model")
    a = Transformer.from_pretrained(str(tmp_path / "straight" / step_3))
    b = Transformer.from_pretrained(str(tmp_path / "resumed" / step_3))
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    lines = [json.loads(line) for line in open(tmp_path / "resumed" / "metrics.jsonl")]
    assert [row["step"] for row in lines if "rollout/acc" in row] == [1, 2, 3]
    # both ranks trained every step
    assert all(row["train/updates"] == 2 for row in lines if "rollout/acc" in row)


# --- a rank that goes wrong -----------------------------------------------------------------------
# two plain processes (tests/dist_fail_worker.py), a few seconds each; those that go wrong inside
# launch.session are in test_launch.py

def test_a_stopped_rank_makes_the_others_fail_naming_the_collective(store_env):
    start = time.time()
    out = first_ranks_output(start_pair("stop", timeout_s=3, store_env=store_env))
    waited = time.time() - start
    assert ("rank 0: all_reduce 'dynamic-sampling count' timed out after 3 s: another rank "
            "stopped" in out), out[-3000:]
    assert waited < 60  # the 3 s timeout plus two interpreter start-ups, not the 30 min default


def test_a_nan_in_one_ranks_shard_stops_every_rank_naming_the_parameter(store_env):
    procs = start_pair("nan", timeout_s=60, store_env=store_env)
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert ("rank 1 raised: after step 3: parameter 'model.layers.1.mlp.down_proj.weight' "
            "holds 1 NaN and 0 inf" in outs[1]), outs[1][-3000:]
    assert ("rank 0 raised: after step 3: parameter 'model.layers.1.mlp.down_proj.weight' "
            "holds NaN/inf values on another rank" in outs[0]), outs[0][-3000:]


def test_a_checkpoint_missing_one_ranks_file_fails_every_rank_at_once(store_env, tiny_model_dir,
                                                                      tmp_path):
    from data import PromptIterator
    from infra import checkpoint, files
    model = Transformer.from_pretrained(tiny_model_dir)
    ckpt = checkpoint.save(str(tmp_path), 1, model, tiny_model_dir,
                           torch.optim.AdamW(model.parameters()), PromptIterator([{"x": 1}], 1, 0),
                           torch.Generator(), {})
    meta = files.read_json(os.path.join(ckpt, "trainer.json"))
    files.write_json(os.path.join(ckpt, "trainer.json"), {**meta, "world_size": 2})
    # a 2-rank checkpoint without trainer_rank1.pt; the ranks wait 120 s for each other
    procs = start_pair("resume", 120, store_env, str(tmp_path))
    try:
        outs = [p.communicate(timeout=60)[0] for p in procs]
    except subprocess.TimeoutExpired:
        pytest.fail("a rank waited for the one that failed")
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for rank, out in enumerate(outs):
        assert (f"rank {rank} raised: --resume: " in out
                and "trainer_rank1.pt is missing" in out), out[-3000:]


def test_a_disagreement_names_the_ranks_of_each_value():
    from infra import distributed
    ranks = [{"--lr": 0.001, "--seed": 0}] * 64 + [{"--lr": 0.5, "--seed": 0}] + \
        [{"--lr": 0.001, "--seed": 0}] * 3
    assert distributed.disagreements(ranks) == ["--lr: 0.001 on ranks 0-63, 65-67, 0.5 on rank 64"]
    assert distributed.disagreements([{"--seed": 0}, {"--seed": 0, "--new": 1}]) == [
        "--new: None on rank 0, 1 on rank 1"]


# dapo.py, with SIGTERM sent to rank 1 alone during step 2's first optimizer step (one node
# preempted: its torchrun forwards the scheduler's signal to its own ranks only)
SIGTERM_ON_RANK_1 = """import os, runpy, signal, sys
sys.path.insert(0, {root!r})
from infra import precision
if os.environ["RANK"] == "1":
    is_finite, calls = precision.gradient_is_finite, iter(range(1, 99))
    def signalled(*args):
        if next(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return is_finite(*args)
    precision.gradient_is_finite = signalled
sys.argv[0] = "dapo.py"
runpy.run_path(os.path.join({root!r}, "dapo.py"), run_name="__main__")
"""


@pytest.mark.needs("all")
def test_a_sigterm_on_one_rank_makes_every_rank_save_the_step_and_exit_143(
        store_env, tiny_model_dir, tmp_path):
    # before: SIGTERM ended rank 1 silently, and rank 0 waited in the next collective
    run = tmp_path / "run"
    env = {**os.environ, **store_env, "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1",
           "TRITON_INTERPRET": "0"}
    procs = [subprocess.Popen([sys.executable, "-c", SIGTERM_ON_RANK_1.format(root=ROOT),
                               "--model", tiny_model_dir, "--out-dir", str(run), "--steps", "3",
                               *SMALL_RUN, "--dist-timeout", "60"],
                              cwd=ROOT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [143, 143], outs
    assert (run / "checkpoints" / "latest").read_text() == "step_000002"
    assert sorted(f.name for f in (run / "checkpoints" / "step_000002").glob("*.pt")) == [
        "trainer_rank0.pt", "trainer_rank1.pt"]
    said = [line for line in outs[0].splitlines() if line.startswith("SIGTERM: stopped")]
    assert said[0].startswith("SIGTERM: stopped after step 2, its checkpoint saved. To resume: "
                              f"torchrun [its flags] {ROOT}/dapo.py --model {tiny_model_dir} "
                              f"--out-dir {run} --steps 3 "), said
    assert said[0].endswith(" --dist-timeout 60 --resume") and len(said) == 1, said


def test_only_an_unnamed_timeout_or_a_lost_peer_is_renamed():
    from infra import distributed
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
                        "waiting 1800000ms for recv operation to complete")
    assert str(distributed.collective_error(gloo, 1800)) == (
        "rank 0: a collective (in the model's forward or backward, or torch's own) timed out "
        "after 1800 s: another rank stopped or is far behind (raise --dist-timeout if it was only "
        f"slow) ({gloo})")
    closed = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
                          "Connection closed by peer [127.0.0.1]:34225. This is typically caused "
                          "by a remote worker crashing.\nmore")
    assert str(distributed.collective_error(closed, 1800)) == (
        "rank 0: a collective (in the model's forward or backward, or torch's own) failed: "
        f"another rank has probably exited ({str(closed).splitlines()[0]})")
    named = RuntimeError("rank 0: all_reduce 'x' timed out after 3 s: ... (raise --dist-timeout "
                         "if it was only slow)")
    for other in (named, RuntimeError("shape mismatch"), ValueError("timed out")):
        assert distributed.collective_error(other, 1800) is None
