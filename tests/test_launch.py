"""launch.py: the set-up before the loop. session() with a rank that dies or stops inside it (two
plain processes, tests/dist_fail_worker.py), check_files, check_ranks_agree (two ranks started with
their own command lines), load_sharded (each of 2 ranks reads its own shard), load_data's check
call of --reward-fn, and user_errors_in_one_line. The refusals that dapo.main makes through these
(a missing file, a directory that holds a run, ...) are in test_loop_guards.py."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from config import Config
from data import PromptIterator, load_tokenizer
from infra import memory
from launch import check_files, load_data, load_verifier, user_errors_in_one_line
from model import ModelConfig, Transformer
from tmpfiles import plain_jsonl, write
from two_ranks import SMALL_RUN, first_ranks_output, start_pair, torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- session(): a rank that dies or stops inside it -----------------------------------------------

def test_a_dead_rank_leaves_the_first_error_last(store_env):
    # before: launch.session's shutdown barrier failed too, and its error, raised last, hid the
    # first ("barrier 'shutdown' failed: another rank has probably exited")
    procs = start_pair("dead", timeout_s=60, store_env=store_env)
    out = first_ranks_output(procs)
    waiting, dead = procs
    assert waiting.returncode != 0 and dead.returncode == 3
    assert "barrier 'shutdown'" not in out, out[-3000:]
    last = out.strip().splitlines()[-1]  # torch prefixes "[rank0]: " to a rank's traceback
    assert ("UserError: rank 0: all_reduce 'dynamic-sampling count' failed: another rank has "
            "probably exited" in last), out[-3000:]


@pytest.mark.needs("rope", "attention")  # rank 0's forward
def test_a_stopped_rank_inside_fsdps_collectives_names_dist_timeout(store_env, tmp_path):
    # before: a raw gloo "Timed out waiting 3000ms for recv operation to complete" from inside
    # FSDP2's forward or backward, with a traceback, naming no flag
    procs = start_pair("fsdp", 3, store_env, str(tmp_path / "run"))
    out = first_ranks_output(procs)
    waiting = procs[0]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert waiting.returncode == 2 and len(errors) == 1, out[-3000:]
    assert errors[0].startswith("error: rank 0: a collective (in the model's forward or "
                                "backward, or torch's own) timed out after 3 s: another rank "
                                "stopped or is far behind (raise --dist-timeout if it was only "
                                "slow) ("), out[-3000:]
    assert "Traceback" not in out, out[-3000:]


@pytest.mark.needs("rope", "attention")  # rank 0's forward
def test_a_dead_rank_inside_fsdps_collectives_is_one_line(store_env, tmp_path):
    # before: rank 0, gathering the weights, ended in a raw gloo traceback ("Connection closed by
    # peer"), naming no collective
    procs = start_pair("fsdp-dead", 60, store_env, str(tmp_path / "run"))
    out = first_ranks_output(procs)
    waiting, dead = procs
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert waiting.returncode == 2 and dead.returncode == 3 and len(errors) == 1, out[-3000:]
    assert errors[0].startswith("error: rank 0: a collective (in the model's forward or "
                                "backward, or torch's own) failed: another rank has probably "
                                "exited ("), out[-3000:]
    assert "Traceback" not in out, out[-3000:]


# --- the flags and the files, checked before anything loads ---------------------------------------

def test_reward_fn_all_rows_needs_reward_fn():
    with pytest.raises(ValueError, match="--reward-fn-all-rows needs --reward-fn"):
        check_files(Config(reward_fn_all_rows=True))


def test_ranks_started_with_other_flags_or_files_are_named_before_anything_loads(
        store_env, tiny_model_dir, tmp_path):
    # two nodes, each with its own command line; rank 1's has another --lr and --steps, and its
    # rows.jsonl (the same relative path, its own directory) other rows. Before: another --lr or
    # other rows trained both ranks on different things, exit 0; another --steps hung until
    # --dist-timeout. Rank 1's copy of the model at another path is not a difference
    from toy import toy_rows
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for seed, node in enumerate(nodes):
        node.mkdir()
        (node / "rows.jsonl").write_text("".join(json.dumps(row) + "\n"
                                                 for row in toy_rows(8, seed)))
    shutil.copytree(tiny_model_dir, nodes[1] / "model")
    flags = ["--out-dir", str(tmp_path / "run"), "--train-data", "rows.jsonl", "--steps", "3",
             *SMALL_RUN, "--dist-timeout", "20"]
    env = {**os.environ, **store_env, "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1",
           "TRITON_INTERPRET": "0"}
    own_flags = [["--model", tiny_model_dir],  # rank 0's, rank 1's
                 ["--model", str(nodes[1] / "model"), "--lr", "0.5", "--steps", "2"]]
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "dapo.py"), *flags, *extra],
                              cwd=node, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r, (node, extra) in enumerate(zip(nodes, own_flags))]
    out = first_ranks_output(procs)
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert errors == ["error: the ranks disagree on the run (every rank must run the same command "
                      "line, on the same files): --steps: 3 on rank 0, 2 on rank 1; --lr: "
                      "0.001 on rank 0, 0.5 on rank 1; --train-data's file (sha256): "
                      f"'{sha256(nodes[0])}' on rank 0, '{sha256(nodes[1])}' on rank 1"], out
    assert procs[0].returncode == 2 and not (tmp_path / "run").exists()


def sha256(node):
    return hashlib.sha256((node / "rows.jsonl").read_bytes()).hexdigest()[:16]


# --- the policy and the data ----------------------------------------------------------------------

@pytest.mark.needs("all")
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])  # Qwen3: no biases, q/k norms, head_dim
def test_two_ranks_load_a_shard_each_and_the_same_weights(tmp_path, family):
    """A 38M-parameter model (152 MB in fp32, its weights saved in bf16 as a Hugging Face
    checkpoint is): each of 2 ranks reads its own rows, so its memory grows by half the fp32 model
    (measured 0.50), not the whole (loaded whole and then sharded: 1.05); and the ranks' weights
    gather to exactly what one process loads."""
    m = ModelConfig(vocab_size=8000, hidden_size=512, intermediate_size=2048,
                    num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                    tie_word_embeddings=False, torch_dtype="bfloat16", model_type=family,
                    head_dim=128 if family == "qwen3" else 0)
    model_dir, out_dir = tmp_path / "model", tmp_path / "out"
    out_dir.mkdir()
    torch.manual_seed(0)
    Transformer(m).bfloat16().save_pretrained(str(model_dir))
    fp32_bytes = memory.parameter_count(m) * 4
    torchrun("tests/load_worker.py", str(model_dir), str(out_dir))
    peaks = [json.loads((out_dir / f"rank{r}.json").read_text())["peak_kb"] * 1024
             for r in (0, 1)]
    assert all(peak < 0.7 * fp32_bytes for peak in peaks), [p / fp32_bytes for p in peaks]
    whole = Transformer.from_pretrained(str(model_dir), dtype=torch.float32).state_dict()
    gathered = torch.load(out_dir / "weights.pt", weights_only=True)
    assert gathered.keys() == whole.keys()
    assert all(torch.equal(gathered[k], whole[k]) for k in whole)


def test_the_check_call_scores_a_row_the_verifier_will_score(tiny_model_dir, tmp_path):
    # before: it scored the first training row, the toy task's '5' without --train-data (which
    # the built-in verifier scores), so --eval-only on your own task was impossible
    val = plain_jsonl(tmp_path / "val.jsonl", [{"prompt": "x1?", "answer": "x1"}])
    picky = write(tmp_path / "picky.py", "def f(r, g):\n    assert g.startswith('x'), g\n"
                                         "    return float(r == g)\n")
    tok = load_tokenizer(tiny_model_dir)
    for eval_only in (True, False):  # training on the toy task, evaluating on your own
        cfg = Config(model=tiny_model_dir, val_data=val, reward_fn=f"{picky}:f",
                     eval_only=eval_only)
        assert load_data(cfg, tok, load_verifier(cfg))[1][0]["reward_model"]["ground_truth"] == "x1"
    broken = write(tmp_path / "broken.py", "def f(r, g):\n    raise KeyError(g)\n")
    cfg = Config(model=tiny_model_dir, val_data=val, reward_fn=f"{broken}:f", eval_only=True)
    with pytest.raises(ValueError, match=r"the check call f\('x1', 'x1'\) failed: KeyError"):
        load_data(cfg, tok, load_verifier(cfg))
    math_row = {"prompt": "1+1?", "answer": "2", "data_source": "math_dapo"}
    cfg = replace(cfg, val_data=plain_jsonl(tmp_path / "math.jsonl", [math_row]))
    # it scores no row: nothing to check it on
    assert len(load_data(cfg, tok, load_verifier(cfg))[1]) == 1


# --- user_errors_in_one_line(): a bug keeps its traceback -----------------------------------------

def unpack_three_into_two():
    first, second = [1, 2, 3]  # noqa: F841


def multiply_mismatched_shapes():
    return torch.zeros(2, 3) @ torch.zeros(2, 3)


def draw_from_no_rows():
    return PromptIterator([], batch_size=1, seed=0)  # a guard of ours on its callers, not a flag


@pytest.mark.parametrize("bug,error", [(unpack_three_into_two, ValueError),
                                       (multiply_mismatched_shapes, RuntimeError),
                                       (draw_from_no_rows, ValueError)])
def test_a_bug_keeps_its_traceback(bug, error):
    # the types of a user's mistake, raised by Python, by torch or by a `raise` of ours that is
    # not a UserError
    with pytest.raises(error):
        with user_errors_in_one_line():
            bug()
