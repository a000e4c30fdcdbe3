"""--report-to: a tiny real run, 2 steps then resumed to 4, logged to TensorBoard, wandb (offline)
and Trackio, each read back with its own package's reader; every number of metrics.jsonl arrives,
at its step, in one run per tracker. No network: wandb offline, Trackio's local database."""
import errno
import glob
import importlib.util
import json
import os
import sys
import threading
import time

import pytest

import dapo
from config import Config, check_flags
from infra import checkpoint, trackers
from infra.errors import UserError

# not imported here: Trackio reads TRACKIO_DIR when it is first imported, by the run below
if any(importlib.util.find_spec(p) is None for p in ("tensorboard", "wandb", "trackio")):
    pytest.skip("tensorboard, wandb and trackio: pip install -r requirements-extra.txt",
                allow_module_level=True)

BLOCK, FULL, LAST = 32 * 1024, 1, 4  # the .wandb file's LevelDB log layout


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory):
    """metrics.jsonl's rows and the out_dir of a run of 2 steps resumed to 4, evaluated at 0, 2
    and 4, logged to every tracker."""
    from test_dapo import _cfg
    tmp = tmp_path_factory.mktemp("trackers")
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp), "WANDB_SILENT": "true",
           "TRACKIO_DIR": str(tmp / "trackio")}
    assert "trackio" not in sys.modules, "trackio imported before TRACKIO_DIR was set"
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        torch_kernel_path(mp)
        everything = ("jsonl", "tensorboard", "wandb", "trackio")
        out = tmp / "run"
        dapo.main(_cfg(tiny_model_dir, out, steps=2, report_to=everything))
        dapo.main(_cfg(tiny_model_dir, out, steps=4, report_to=everything, resume=True))
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return rows, out, tmp


def torch_kernel_path(mp):
    """The kernel's PyTorch path, as test_dapo's runs (not Triton's interpreter: slow)."""
    import logprobs
    from dapo_kernels import linear_logprobs_and_entropy, logprobs_and_entropy
    mp.setattr(logprobs, "logprobs_and_entropy",
               lambda *a, **k: logprobs_and_entropy(*a, **k, backend="torch"))
    mp.setattr(logprobs, "linear_logprobs_and_entropy",
               lambda *a, **k: linear_logprobs_and_entropy(*a, **k, backend="torch"))


def expected(rows) -> dict:
    """{(step, key): value} of every number of metrics.jsonl."""
    from infra.trackers import scalars
    return {(r["step"], k): v for r in rows for k, v in scalars(r).items()}


@pytest.mark.needs("all")
def test_metrics_jsonl_has_evaluations_and_steps_1_to_4(run):
    rows, _, _ = run
    assert [r["step"] for r in rows if "rollout/acc" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in rows if "val/acc" in r] == [0, 2, 4]


@pytest.mark.needs("all")
def test_metrics_jsonl_begins_with_the_settings_the_run_resolved(run):
    # before: only trainer.json said whether a run was bf16; its rows did not
    rows, out, _ = run
    saved = checkpoint.saved_config(checkpoint.latest(str(out)))
    assert rows[0] == {"step": 0, "config": {**saved, "steps": 2, "resume": False}}
    assert rows[0]["config"]["precision"] == "fp32"  # --precision auto, as it resolved
    assert [r for r in rows if "config" in r] == rows[:1]  # the resume kept it, added none


@pytest.mark.needs("all")
def test_tensorboard_reads_back_every_number_at_its_step(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    rows, out, _ = run
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    got = {}
    for tag in acc.Tags()["scalars"]:
        steps = [e.step for e in acc.Scalars(tag)]
        assert len(steps) == len(set(steps)), f"{tag}: a step twice, {steps}"
        got |= {(e.step, tag): e.value for e in acc.Scalars(tag)}
    want = expected(rows)
    assert got.keys() == want.keys()
    assert all(got[k] == pytest.approx(v, rel=1e-6, abs=1e-30) for k, v in want.items())
    config = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(config.strip("`\n"))["group_size"] == 4  # the hyperparameters, as text


def wandb_records(path: str) -> list:
    """The records of a .wandb file: a 7-byte header, then LevelDB log blocks of 32 KiB, each
    record a 7-byte header (crc, length, type) and a fragment (full, or first/middle/last)."""
    from wandb.proto.wandb_internal_pb2 import Record
    data, pos, part, out = open(path, "rb").read(), 7, b"", []
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        part, pos = part + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (FULL, LAST):
            out.append(Record.FromString(part))
            part = b""
    return out


@pytest.mark.needs("all")
def test_wandb_offline_files_hold_every_number_in_one_run(run):
    rows, out, tmp = run
    run_id = json.load(open(out / "trackers.json"))["wandb_id"]
    files = sorted(glob.glob(str(tmp / "wandb" / "offline-run-*" / f"run-{run_id}.wandb")))
    assert len(files) == 2  # the run, and the same run resumed
    got, config, train_steps = {}, {}, []
    for record in (r for f in files for r in wandb_records(f)):
        if record.HasField("history"):
            step = record.history.step.num
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in record.history.item}
            got |= {(step, k): v for k, v in items.items() if not k.startswith("_")}
            train_steps += [step] * ("rollout/acc" in items)
        if record.HasField("run"):  # the run's config, in the first record of each file
            config |= {i.key: json.loads(i.value_json) for i in record.run.config.update}
    assert train_steps == [1, 2, 3, 4]
    want = expected(rows)
    assert got.keys() == want.keys()
    assert all(got[k] == pytest.approx(v, rel=1e-12) for k, v in want.items())
    assert config["group_size"] == 4 and config["report_to"][1] == "tensorboard"


@pytest.mark.needs("all")
def test_trackio_database_holds_every_number_in_one_run(run):
    from trackio.sqlite_storage import SQLiteStorage
    rows, out, _ = run
    name = json.load(open(out / "trackers.json"))["name"]
    assert SQLiteStorage.get_runs("dapo") == [name]
    logs = SQLiteStorage.get_logs("dapo", name)
    got = {(log["step"], k): v for log in logs for k, v in log.items()
           if k not in ("step", "timestamp")}
    assert [log["step"] for log in logs if "rollout/acc" in log] == [1, 2, 3, 4]
    want = expected(rows)
    assert got.keys() >= want.keys()  # and Trackio's own system metrics, if any
    assert all(got[k] == pytest.approx(v, rel=1e-12) for k, v in want.items())


def test_a_tracker_not_installed_is_refused_before_anything_loads(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    monkeypatch.setattr(dapo.launch, "load_policy", lambda cfg: pytest.fail("loaded the model"))
    cfg = Config(out_dir=str(tmp_path / "x"), report_to=("jsonl", "wandb"))
    with pytest.raises(ValueError, match=r"--report-to wandb: the 'wandb' package is not "
                                         r"installed \(pip install -r requirements-extra.txt\)"):
        dapo.main(cfg)
    assert not os.path.exists(cfg.out_dir)
    check_flags(Config(report_to=("jsonl", "tensorboard")))  # an installed one passes


@pytest.mark.needs("all")
def test_eval_only_logs_to_runs_of_its_own(run, tiny_model_dir, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from test_dapo import _cfg
    _, out, tmp = run
    before = (out / "trackers.json").read_text()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp))
    torch_kernel_path(monkeypatch)
    result = dapo.main(_cfg(tiny_model_dir, out, eval_only=True,
                            report_to=("tensorboard", "wandb")))
    assert (out / "trackers.json").read_text() == before  # the training run's ids stay
    acc = EventAccumulator(str(out / "tensorboard-eval"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("val/acc")] == [(0, result["val/acc"])]
    files = glob.glob(str(tmp / "wandb" / "offline-run-*" / "*.wandb"))
    assert sum(json.loads(before)["wandb_id"] not in f for f in files) == 1  # a run of its own


def test_a_torn_last_row_is_skipped_when_tensorboard_logs_the_resumed_step_again(tmp_path):
    # before: a resume with nothing to do (metrics.jsonl left as the crash did) met the torn row:
    # json.decoder.JSONDecodeError
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 2, "rollout/acc": 0.5}\n{"step": 2, "val/ac')
    cfg = Config(out_dir=str(tmp_path), report_to=("tensorboard",))
    trackers.close(trackers.open_all(cfg, 2, str(metrics)))
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("rollout/acc")] == [(2, 0.5)]
    assert acc.Tags()["scalars"] == ["rollout/acc"]
    metrics.write_text('{"step": 2\n{"step": 2, "rollout/acc": 0.5}\n')  # not the last: named
    with pytest.raises(UserError, match=rf"^{metrics}:1: not a JSON row; fix or remove the line"):
        trackers.open_all(cfg, 2, str(metrics))


def a_full_disk(self, data):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("logs", [50, 1], ids=["while-logging", "at-close"])
def test_a_full_disk_under_tensorboard_is_one_error_naming_the_directory(tmp_path, monkeypatch,
                                                                         capfd, logs):
    # before: the writer's thread printed its traceback ("Exception in thread"), then the next
    # row raised it again in the run: OSError, naming no file
    from tensorboard.summary.writer import record_writer
    hook = threading.excepthook
    tb = trackers.TensorBoard(str(tmp_path / "tensorboard"), {}, None)
    monkeypatch.setattr(record_writer.RecordWriter, "write", a_full_disk)
    said = rf"^could not write {tmp_path}/tensorboard \(--report-to tensorboard\): the disk is full"
    with pytest.raises(UserError, match=said):
        for step in range(1, logs + 1):  # the writer's thread fails, the next row says so
            tb.log({"step": step, "rollout/acc": 0.5}, step)
            time.sleep(0.01)
        tb.close()  # a failure after the last row: said when the thread is joined
    tb.log({"step": 99, "rollout/acc": 0.5}, 99)  # said once: nothing more is written or said
    tb.close()
    assert threading.excepthook is hook
    assert "Traceback" not in capfd.readouterr().err
