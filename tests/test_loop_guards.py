"""dapo.py refuses what would waste or destroy a run, before loading anything: bad flags, a
directory that holds another run, missing files, a resume that changes the algorithm; and it stops
at NaN weights, and with a non-zero exit when every update was skipped. On the command line such
a mistake is one line `error: ...`, exit status 2."""
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import dapo
import launch
from batches import random_batch
from config import parse_args
from infra import interrupt
from infra.errors import UserError
from model import Transformer, preset
from test_dapo import _cfg, torch_kernel_path  # noqa: F401 (an autouse fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("overrides,message", [
    (dict(group_size=0), "--group-size must be >= 1, got 0"),
    (dict(eval_samples=0), "--eval-samples must be >= 1, got 0"),
    (dict(micro_batch_size=0), "--micro-batch-size must be >= 1, got 0"),
    (dict(max_response_len=0), "--max-response-len must be >= 1, got 0"),
    (dict(max_prompt_len=0), "--max-prompt-len must be >= 1, got 0"),
    (dict(max_prompt_len=-3), "--max-prompt-len must be >= 1, got -3"),
    (dict(overlong_buffer=50, max_response_len=40), "--overlong-buffer must be in (0, "
                                                    "--max-response-len=40]"),
    (dict(temperature=0.0), "--temperature must be > 0"),
    (dict(train_prompts=5, mini_batch_prompts=2), "--train-prompts must be a multiple of "
                                                  "--mini-batch-prompts=2"),
    (dict(top_p=0.0), "--top-p must be in (0, 1]"),
    # before: a ZeroDivisionError inside these checks
    (dict(mini_batch_prompts=0), "--mini-batch-prompts must be >= 1, got 0"),
    # before: numpy's generator refused -1 after the model had loaded
    (dict(seed=-1), "--seed must be in [0, 2**63), got -1"),
    (dict(seed=2**64), "--seed must be in [0, 2**63), got 18446744073709551616"),
    (dict(resume=True, overwrite=True), "pick one"),
    (dict(device="foo"), "--device must be cpu, cuda or cuda:N, got 'foo'"),
    (dict(device="cuda:99"), "--device must be a CUDA device this machine has"),
    *([(dict(device="cuda"), "--device must be a CUDA device this machine has (it has none)")]
      if not torch.cuda.is_available() else []),
])
def test_a_bad_flag_is_named_before_anything_is_loaded(tmp_path, overrides, message):
    with pytest.raises(ValueError, match="bad flags") as e:
        dapo.main(dapo.Config(out_dir=str(tmp_path / "run"), **overrides))
    assert message in str(e.value)
    assert not (tmp_path / "run").exists()  # nothing was created, loaded or trained


def test_compile_under_several_processes_is_refused_naming_why(monkeypatch, tmp_path):
    # before: torchrun --nproc_per_node=2 dapo.py --compile failed in the first decode step, inside
    # torch._dynamo ("Attempted to call function marked as skipped", FSDP2's hook)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="bad flags") as e:
        dapo.main(dapo.Config(out_dir=str(tmp_path / "run"), compile=True))
    assert "--compile runs in one process only, got 2" in str(e.value)
    assert not (tmp_path / "run").exists()


def few_rows(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({
        "data_source": "math_dapo", "prompt": [{"role": "user", "content": f"{k} + 1?"}],
        "reward_model": {"ground_truth": str(k + 1)}}) + "\n" for k in range(3)))
    return rows


def test_fewer_rows_than_a_generation_batch_names_the_flag(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="3 usable rows, fewer than --gen-prompts 4"):
        dapo.main(_cfg(tiny_model_dir, tmp_path / "run", train_data=str(few_rows(tmp_path)),
                       dynamic_sampling=True))


@pytest.mark.parametrize("with_model", [True, False])
def test_lengths_beyond_the_models_positions_are_refused_before_anything_is_written(
        tiny_model_dir, tmp_path, with_model):
    # the tiny and the demo model both have 1024 positions
    lengths = dict(max_prompt_len=1000, max_response_len=25, overlong_buffer=4)
    cfg = (_cfg(tiny_model_dir, tmp_path / "run", **lengths) if with_model
           else dapo.Config(out_dir=str(tmp_path / "run"), **lengths))
    source = r".*/config\.json \(max_position_embeddings\)" if with_model else "the demo model"
    with pytest.raises(ValueError, match=rf"--max-prompt-len 1000 \+ --max-response-len 25 = "
                                         rf"1025 tokens, more than the 1024 positions of {source}"):
        dapo.main(cfg)
    assert not (tmp_path / "run").exists()
    if with_model:  # at the limit it runs on (and fails later, on purpose: too few rows)
        with pytest.raises(ValueError, match="usable rows"):
            dapo.main(_cfg(tiny_model_dir, tmp_path / "run", **lengths | dict(max_prompt_len=999),
                           train_data=str(few_rows(tmp_path))))

@pytest.mark.needs("all")
def test_a_new_run_never_destroys_the_run_in_its_directory(tiny_model_dir, tmp_path):
    dapo.main(_cfg(tiny_model_dir, tmp_path, steps=1, eval_every=0))
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(UserError, match="--resume .* or --overwrite"):
        dapo.main(_cfg(tiny_model_dir, tmp_path, steps=1, eval_every=0, lr=1.0))
    assert (tmp_path / "metrics.jsonl").read_text() == before
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000001"
    dapo.main(_cfg(tiny_model_dir, tmp_path, steps=1, eval_every=0, overwrite=True))


def test_overwrite_never_deletes_the_model_it_trains_from(tiny_model_dir, tmp_path):
    # train on from a run's own checkpoint with new settings: before, --overwrite deleted
    # checkpoints/ first, then failed with "config.json: not found"
    model_dir = tmp_path / "checkpoints" / "step_000003" / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    (tmp_path / "checkpoints" / "latest").write_text("step_000003")
    (tmp_path / "metrics.jsonl").write_text('{"step": 3}\n')
    with pytest.raises(UserError, match=r"--model .*step_000003/model lies in .*, in what "
                                        "--overwrite deletes"):
        dapo.main(_cfg(str(model_dir), tmp_path, overwrite=True, lr=1e-4))
    assert sorted(os.listdir(model_dir)) == sorted(os.listdir(tiny_model_dir))
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 3}\n'


@pytest.mark.needs("all")
def test_a_resume_that_changes_the_algorithm_is_refused(tiny_model_dir, tmp_path):
    dapo.main(_cfg(tiny_model_dir, tmp_path, steps=1, eval_every=0))
    with pytest.raises(ValueError, match="--group-size: 4 in the checkpoint, 2 now"):
        dapo.main(_cfg(tiny_model_dir, tmp_path, steps=2, eval_every=0, resume=True,
                       group_size=2))
    dapo.main(_cfg(tiny_model_dir, tmp_path, steps=2, eval_every=0, resume=True))  # --steps may


@pytest.mark.needs("all")
def test_a_step_logged_but_not_saved_is_logged_once_after_the_resume(tiny_model_dir, tmp_path):
    dapo.main(_cfg(tiny_model_dir, tmp_path, steps=2, eval_every=0, save_every=1))
    with open(tmp_path / "metrics.jsonl", "a") as f:  # step 3 logged, then a crash before its save
        f.write(json.dumps({"step": 3, "rollout/acc": 0.0}) + "\n")
    dapo.main(_cfg(tiny_model_dir, tmp_path, steps=4, eval_every=0, save_every=1, resume=True))
    steps = [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")]
    assert steps == [0, 1, 2, 3, 4]  # the run's settings, then each step once


class Killed(BaseException):
    """The process killed here (no `except` of the run catches it)."""


def rows(out_dir) -> list[dict]:
    """metrics.jsonl's rows without their timings (which differ from run to run) and the
    settings row's flags (its --out-dir)."""
    with open(out_dir / "metrics.jsonl") as f:
        return [{k: v for k, v in json.loads(line).items()
                 if not k.startswith(("timing/", "perf/")) and k != "config"} for line in f]


@pytest.fixture
def uninterrupted(tiny_model_dir, tmp_path) -> list[dict]:
    """The rows of a run of _cfg's 3 steps (evaluated at 0, 2 and 3) that nothing stopped (on
    the kernel's torch path, as the autouse fixture makes every test's)."""
    dapo.main(_cfg(tiny_model_dir, tmp_path / "uninterrupted"))
    return rows(tmp_path / "uninterrupted")


@pytest.mark.needs("all")
def test_a_run_killed_in_its_final_evaluation_makes_it_on_resume(tiny_model_dir, tmp_path,
                                                                 monkeypatch, uninterrupted):
    # before: the resume said "nothing to do", exit 0, and the final val row was never written
    evaluate, calls = dapo.evaluate, itertools.count(1)

    def killed_in_the_third(*args, **kwargs):
        if next(calls) == 3:
            raise Killed
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(dapo, "evaluate", killed_in_the_third)
    with pytest.raises(Killed):  # in the final evaluation, after the last checkpoint
        dapo.main(_cfg(tiny_model_dir, tmp_path / "killed"))
    monkeypatch.setattr(dapo, "evaluate", evaluate)
    assert [r["step"] for r in rows(tmp_path / "killed") if "val/acc" in r] == [0, 2]
    dapo.main(_cfg(tiny_model_dir, tmp_path / "killed", resume=True))
    assert rows(tmp_path / "killed") == uninterrupted


def unhandled(signum, frame):
    raise AssertionError(f"signal {signum} reached no handler of the run")


@pytest.fixture
def signals_unhandled():
    """SIGINT and SIGTERM fail the test where the run does not handle them (instead of stopping
    pytest, or killing it); the handlers in place before are put back after."""
    before = {s: signal.signal(s, unhandled) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in before.items():
        signal.signal(s, handler)


@pytest.mark.needs("all")
@pytest.mark.parametrize("signum,status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["ctrl-c", "sigterm"])
def test_a_signal_ends_the_step_saves_it_and_says_how_to_resume(
        tiny_model_dir, tmp_path, monkeypatch, capsys, uninterrupted, signals_unhandled, signum,
        status):
    # before: Ctrl-C was a KeyboardInterrupt traceback from wherever it landed, SIGTERM a silent
    # exit; neither said how to resume, and with --save-every 0 (here) every step was lost
    update, calls = dapo.update_policy, itertools.count(1)

    def signalled_in_step_2(*args, **kwargs):
        if next(calls) == 2:
            os.kill(os.getpid(), signum)  # its handler runs now, before the update
        return update(*args, **kwargs)

    monkeypatch.setattr(dapo, "update_policy", signalled_in_step_2)
    out_dir = tmp_path / "stopped"
    monkeypatch.setattr(sys, "argv", ["dapo.py", "--out-dir", str(out_dir), "--overwrite"])
    with pytest.raises(SystemExit) as stopped:
        dapo.main(_cfg(tiny_model_dir, out_dir))
    assert stopped.value.code == status
    assert (out_dir / "checkpoints" / "latest").read_text() == "step_000002"
    assert (f"stopped after step 2, its checkpoint saved. To resume: python dapo.py --out-dir "
            f"{out_dir} --resume\n") in capsys.readouterr().out
    assert signal.getsignal(signum) is unhandled  # the run's handlers gone
    monkeypatch.setattr(dapo, "update_policy", update)
    dapo.main(_cfg(tiny_model_dir, out_dir, resume=True))  # as the line says
    assert rows(out_dir) == uninterrupted  # step 2 was whole: the same run


def test_a_second_ctrl_c_stops_at_once_a_second_sigterm_does_not(signals_unhandled):
    stop = interrupt.Stop()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # torchrun forwards the scheduler's: the same stop
        assert stop.requested() and stop.signum == signal.SIGTERM
    finally:
        interrupt.restore()
    stop = interrupt.Stop()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested() and stop.signum == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        interrupt.restore()
    assert signal.getsignal(signal.SIGINT) is unhandled


def ctrl_c(*args):
    raise KeyboardInterrupt  # what Python's own SIGINT handler raises


def test_a_ctrl_c_that_stops_at_once_is_one_line_and_exit_status_130(tmp_path, capsys,
                                                                      monkeypatch):
    # before: a KeyboardInterrupt traceback (here: a Ctrl-C while the model loads)
    monkeypatch.setattr(launch, "setup", ctrl_c)
    try:
        command_line(["--out-dir", str(tmp_path / "run")])
    except BaseException as e:  # a KeyboardInterrupt that got through would stop pytest
        stopped = e
    assert isinstance(stopped, SystemExit) and stopped.code == 130
    assert capsys.readouterr().err == "error: interrupted (Ctrl-C)\n"


@pytest.mark.needs("all")
def test_a_finished_run_resumed_for_more_steps_keeps_its_final_evaluation(tiny_model_dir,
                                                                          tmp_path):
    # before: --resume --steps 4 dropped the step-3 evaluation of the finished 3-step run (made
    # after its last checkpoint, as the loop's evaluations are) and never made it again
    dapo.main(_cfg(tiny_model_dir, tmp_path / "four", steps=4))
    dapo.main(_cfg(tiny_model_dir, tmp_path / "three"))
    three = rows(tmp_path / "three")
    assert [r["step"] for r in three if "val/acc" in r] == [0, 2, 3]
    dapo.main(_cfg(tiny_model_dir, tmp_path / "three", steps=4, resume=True))
    # the 3-step run's rows, then the 4-step run's after step 3: step 4's and its evaluation
    assert rows(tmp_path / "three") == three + [r for r in rows(tmp_path / "four")
                                                if r["step"] > 3]


@pytest.mark.needs("all")
def test_keep_checkpoints_keeps_the_last_ones(tiny_model_dir, tmp_path):
    dapo.main(_cfg(tiny_model_dir, tmp_path, steps=3, eval_every=0, save_every=1,
                   keep_checkpoints=2))
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir())
    assert kept == ["step_000002", "step_000003"]


@pytest.mark.needs("policy_loss", "token_count", "logprobs_forward", "logprobs_backward", "rope",
                   "attention")
def test_a_nan_weight_after_an_optimizer_step_stops_the_update():
    torch.manual_seed(0)
    model = Transformer(preset("tiny", vocab_size=50))

    class Poisoned(torch.optim.SGD):
        def step(self, closure=None):
            super().step(closure)
            with torch.no_grad():
                model.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")

    with pytest.raises(FloatingPointError, match="model.layers.1.mlp.up_proj.weight"):
        dapo.update_policy(model, Poisoned(model.parameters(), lr=0.1), random_batch(50),
                           dapo.Config(group_size=4))


@pytest.mark.needs("all")
def test_a_resume_with_nothing_to_do_says_so_and_changes_nothing(tiny_model_dir, tmp_path, capsys):
    dapo.main(_cfg(tiny_model_dir, tmp_path, steps=2, eval_every=1, save_every=1))
    before = (tmp_path / "metrics.jsonl").read_text()
    assert '{"step": 2, "val/acc"' in before  # the final evaluation
    for steps in (2, 1):  # the finished run, and fewer steps than its checkpoint
        capsys.readouterr()
        dapo.main(_cfg(tiny_model_dir, tmp_path, steps=steps, eval_every=1, save_every=1,
                       resume=True))
        assert f"at step 2 and --steps is {steps}: nothing to do" in "".join(capsys.readouterr())
        assert (tmp_path / "metrics.jsonl").read_text() == before
        assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000002"


@pytest.mark.needs("all")
def test_a_run_whose_every_update_is_skipped_exits_non_zero(tiny_model_dir, tmp_path, capsys,
                                                            monkeypatch):
    # a NaN in every loss, as a NaN reward made before it was refused: every gradient norm is NaN
    # and every update skipped. Before, the run logged train/updates 0 and exited 0 (2 steps are
    # far from --stop-when-stuck 20)
    policy_loss = dapo.policy_loss
    monkeypatch.setattr(dapo, "policy_loss", lambda *a, **k: replace(
        out := policy_loss(*a, **k), loss=out.loss * float("nan")))
    with pytest.raises(SystemExit) as stopped:
        dapo.main(_cfg(tiny_model_dir, tmp_path, steps=2, eval_every=0, dynamic_sampling=False))
    assert stopped.value.code == 1
    out = capsys.readouterr().out
    assert "error: all 4 optimizer steps of this run were skipped" in out
    assert "warning: step 2: all 2 optimizer steps skipped (a NaN or inf gradient norm)" in out
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")][1:]  # the steps
    assert [(r["train/updates"], r["actor/grad_norm"]) for r in rows] == [(0, None), (0, None)]
# --- a user's mistake on the command line: one line, exit status 2; a bug: a traceback ----------

def command_line(argv):
    """What `python dapo.py ARGV` runs, in this process."""
    with launch.user_errors_in_one_line():
        dapo.main(parse_args(argv, description=dapo.__doc__))


@pytest.mark.parametrize("argv,message", [
    (["--lr", "abc"], "error: argument --lr: invalid float value: 'abc' (dapo.py --help lists "
                      "the flags)"),
    (["--group-size", "0", "--lr", "-1"], "error: bad flags: --group-size must be >= 1, got 0; "
                                          "--lr must be >= 0, got -1.0"),
    (["--train-data", "no/such.jsonl"], "error: --train-data no/such.jsonl: no such file"),
    (["--reward-fn", "no/such.py:score"], "error: --reward-fn 'no/such.py:score': no file "
                                           "no/such.py"),
    (["--rollout-slots", "many"], "error: argument --rollout-slots: a number or auto, got 'many' "
                                  "(dapo.py --help lists the flags)"),
], ids=["argparse", "check_flags", "train-data", "reward-fn", "rollout-slots"])
def test_a_users_mistake_is_one_line_and_exit_status_2(tmp_path, capsys, monkeypatch, argv,
                                                       message):
    monkeypatch.setattr(sys, "argv", ["dapo.py"])  # argparse names the program after argv[0]
    with pytest.raises(SystemExit) as stopped:
        command_line(["--out-dir", str(tmp_path / "run"), *argv])
    assert stopped.value.code == 2
    out, err = capsys.readouterr()
    assert err == message + "\n" and out == ""
    assert not (tmp_path / "run").exists()


def test_the_command_line_refuses_a_directory_that_holds_a_run_in_one_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    out = subprocess.run([sys.executable, "dapo.py", "--out-dir", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    # stdout: nothing but the memory plan, printed at every start
    assert out.returncode == 2 and all(line.startswith(("memory plan", "  "))
                                       for line in out.stdout.splitlines())
    assert out.stderr == (f"error: {tmp_path} already holds a run (metrics.jsonl): pass --resume "
                          "to continue it, or --overwrite to delete its metrics and checkpoints "
                          "and start again (or choose another --out-dir)\n")


# dapo.py with rank 0 late, so that the other rank reaches the mistake first (the order in which a
# rank that reports without waiting would go unheard, or be heard instead of rank 0)
RANK_0_LATE = """import os, runpy, sys, time
if os.environ["RANK"] == "0":
    time.sleep(3)
sys.path.insert(0, {root!r})
sys.argv[0] = "dapo.py"
runpy.run_path(os.path.join({root!r}, "dapo.py"), run_name="__main__")
"""


def test_under_torchrun_rank_0_alone_reports_a_mistake(tmp_path):
    # before: each rank printed its traceback, then torchrun its ChildFailedError block
    script = tmp_path / "late_rank_0.py"
    script.write_text(RANK_0_LATE.format(root=ROOT))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node=2", str(script), "--compile", "--out-dir",
                          str(tmp_path / "run")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert errors == ["error: bad flags: --compile runs in one process only, got 2: the compiled "
                      "decode step is one graph, and FSDP2's hooks in each block cannot be traced"]
    assert "dapo.py\", line" not in out.stderr  # no traceback of ours (torchrun adds its own)
    # torchrun's summary: rank 0 stopped with status 2, then torchrun ended rank 1 (SIGTERM)
    # while it waited
    assert "rank      : 0 (local_rank: 0)\n  exitcode  : 2 " in out.stderr
    assert "rank      : 1 (local_rank: 1)\n  exitcode  : -15 " in out.stderr
    assert out.returncode != 0 and not (tmp_path / "run").exists()


# --- the files the flags name: checked before the model loads ------------------------------------

@pytest.fixture
def no_model(monkeypatch):
    """The run fails the test if it gets as far as loading a model."""
    monkeypatch.setattr(dapo.launch, "load_policy", lambda cfg: pytest.fail("loaded the model"))


@pytest.mark.parametrize("flags,message", [
    (dict(train_data="no/such.jsonl"), "--train-data no/such.jsonl: no such file"),
    (dict(val_data="no/such.parquet"), "--val-data no/such.parquet: no such file"),
    (dict(train_data="{tmp}/rows.csv"), "--train-data .*/rows.csv: unknown data format"),
    (dict(reward_fn="no/such.py:score"), "--reward-fn 'no/such.py:score': no file"),
], ids=["train-data", "val-data", "format", "reward-fn"])
def test_a_missing_file_is_named_before_the_model_loads(tmp_path, no_model, flags, message):
    (tmp_path / "rows.csv").write_text("prompt,answer\n")
    flags = {k: v.format(tmp=tmp_path) for k, v in flags.items()}
    with pytest.raises(UserError, match=message):
        dapo.main(dapo.Config(out_dir=str(tmp_path / "run"), **flags))
    assert not (tmp_path / "run").exists()


def test_a_parquet_without_pyarrow_is_refused_before_the_model_loads(tmp_path, no_model,
                                                                     monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow` raises ImportError
    (tmp_path / "dapo-math-17k.parquet").write_bytes(b"PAR1")
    with pytest.raises(UserError, match=r"dapo-math-17k.parquet needs pyarrow.*pip install -r "
                                        r"requirements-extra.txt"):
        dapo.main(dapo.Config(out_dir=str(tmp_path / "run"),
                              train_data=str(tmp_path / "dapo-math-17k.parquet")))


@pytest.mark.parametrize("text", ["garbage{", '{"model": {"type": "BPE"'], ids=["not-json",
                                                                              "truncated"])
def test_a_broken_tokenizer_json_is_named_before_the_weights_load(tiny_model_dir, tmp_path,
                                                                  monkeypatch, text):
    # before: "Exception: expected value at line 1 column 1", naming no file, after the weights
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / "tokenizer.json").write_text(text)
    monkeypatch.setattr(launch.Transformer, "from_pretrained",
                        lambda *a, **k: pytest.fail("loaded the weights"))
    with pytest.raises(UserError, match=rf"^{re.escape(str(model_dir / 'tokenizer.json'))}: not "
                                        r"a tokenizer the tokenizers library reads, truncated or "
                                        r"corrupt \(a partial copy\?\): "):
        dapo.main(_cfg(str(model_dir), tmp_path / "run"))


@pytest.mark.needs("filter_logits", "sample", "rope", "attention", "kv_cache")  # the evaluation
def test_the_reward_file_is_imported_once_before_the_model_loads(tiny_model_dir, tmp_path,
                                                                 monkeypatch):
    events = tmp_path / "events"
    verifier = tmp_path / "verifier.py"
    verifier.write_text(f"open({str(events)!r}, 'a').write('import\\n')\n"
                        "def score(response, truth):\n    return float(response == truth)\n")
    load_policy = launch.load_policy

    def logged_load_policy(cfg):
        with open(events, "a") as f:
            f.write("model\n")
        return load_policy(cfg)

    monkeypatch.setattr(dapo.launch, "load_policy", logged_load_policy)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{k} + 1?", "answer": str(k + 1)}) + "\n"
                            for k in range(4)))
    dapo.main(_cfg(tiny_model_dir, tmp_path / "run", eval_only=True, train_data=str(rows),
                   val_data=str(rows), reward_fn=f"{verifier}:score", eval_samples=1,
                   max_response_len=4))
    assert events.read_text().split() == ["import", "model"]


# --- round 4: flags a hostile user gives (each failed before its fix) -----------------------------

def test_a_negative_plan_on_the_command_line_is_refused_not_read_as_a_bare_plan(tmp_path,
                                                                                capsys,
                                                                                monkeypatch):
    monkeypatch.setattr(sys, "argv", ["dapo.py"])
    with pytest.raises(SystemExit) as stopped:
        command_line(["--out-dir", str(tmp_path / "run"), "--plan", "-7"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == ("error: argument --plan: a number of processes >= 1 (0: "
                                       "off), got '-7' (dapo.py --help lists the flags)\n")


@pytest.mark.parametrize("make,eval_only,message", [
    (lambda d: (d / "run").write_text("a file"), False, r"--out-dir {d}/run: {d}/run is not a "
                                                        r"directory"),
    (lambda d: (d / "run").write_text("a file"), True, r"--out-dir {d}/run: {d}/run is not a "
                                                       r"directory"),
    (lambda d: ((d / "run").mkdir(), (d / "run" / "checkpoints").symlink_to(d / "gone")), False,
     r"--out-dir's checkpoints {d}/run/checkpoints is a link to {d}/gone, which does not exist"),
    (None, False, r"--out-dir /proc/dapo-run/x: cannot write in /proc \("),
], ids=["a-file", "a-file-eval-only", "dangling-checkpoints", "proc"])
def test_a_directory_the_run_cannot_write_is_named_before_the_model_loads(tmp_path, no_model, make,
                                                                         eval_only, message):
    # before: found at the first save (with --save-every 0 the end of the run, every step lost),
    # after the whole evaluation with --eval-only, or a traceback from os.makedirs
    out_dir = "/proc/dapo-run/x" if make is None else str(tmp_path / "run")
    if make:
        make(tmp_path)
    with pytest.raises(UserError, match=message.format(d=tmp_path)):
        dapo.main(dapo.Config(out_dir=out_dir, eval_only=eval_only))
    assert not os.path.exists(tmp_path / "gone")


def test_an_unwritable_out_dir_is_one_line_on_the_command_line(tmp_path, no_model, capsys,
                                                              monkeypatch):
    monkeypatch.setattr(sys, "argv", ["dapo.py"])
    (tmp_path / "run").write_text("a file")
    with pytest.raises(SystemExit) as stopped:
        command_line(["--out-dir", str(tmp_path / "run")])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (f"error: --out-dir {tmp_path}/run: {tmp_path}/run is not a "
                                       "directory\n")
