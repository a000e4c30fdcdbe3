"""
Where the rows of metrics.jsonl also go (--report-to): TensorBoard, Weights & Biases, Trackio.
metrics.jsonl is always written (infra/metrics.py's RunLog); each tracker here gets the same rows,
their numbers only, at the row's step, with the run's Config as its hyperparameters (which
metrics.jsonl holds in its first row, {"step": 0, "config": ...}). Rank 0 only.

    out_dir/tensorboard/   TensorBoard's event files (`tensorboard --logdir out_dir/tensorboard`)
    out_dir/trackers.json  the wandb run id and the Trackio run name: --resume continues those runs
    wandb's files          under $WANDB_DIR (default ./wandb); WANDB_MODE=offline writes only there
    Trackio's database     under $TRACKIO_DIR (default ~/.cache/huggingface/trackio)

The packages are optional (requirements-extra.txt) and imported only when a tracker is opened;
missing() lets config.check_flags refuse one that is not installed before anything loads.
"""
import contextlib
import importlib.util
import json
import math
import os
import shutil
import threading
import time
from dataclasses import asdict

from infra import distributed, files
from infra.errors import UserError

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}
PROJECT = "dapo"  # the wandb and Trackio project every run logs to
_open = []  # the trackers of this process's run, closed by close_all()


def missing(report_to) -> list[str]:
    """The --report-to trackers whose package is not installed, as the lines of an error."""
    return [f"--report-to {name}: the {package!r} package is not installed "
            "(pip install -r requirements-extra.txt)"
            for name, package in PACKAGES.items()
            if name in report_to and importlib.util.find_spec(package) is None]


def scalars(row: dict) -> dict:
    """The row's finite numbers: what a tracker plots (not "step", which is its x axis)."""
    return {k: float(v) for k, v in row.items() if k != "step" and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)}


class TensorBoard:
    """Event files in out_dir/tensorboard/. purge_step: on resume, TensorBoard's readers drop what
    the run logged at that step and after (as checkpoint.resume trims metrics.jsonl); `replay`,
    the rows metrics.jsonl keeps at that step, are logged again.

    The writer writes in a thread of its own, and re-raises its error (a full disk) at the next
    call: that error is one line naming the directory, said once, and the thread's own traceback,
    which would say it first, is kept for it (threading.excepthook, while the writer is open)."""

    def __init__(self, log_dir: str, config: dict, purge_step: int | None, replay=()):
        from torch.utils.tensorboard import SummaryWriter
        self.where = f"{log_dir} (--report-to tensorboard)"
        self.failed, self.thread_error = False, None
        self.previous_hook, threading.excepthook = threading.excepthook, self._thread_died
        with self._writing():
            self.writer = SummaryWriter(log_dir, purge_step=purge_step)
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```", 0)
        for row in replay:
            self.log(row, row["step"])

    def log(self, row: dict, step: int):
        if self.failed:  # said once
            return
        with self._writing():
            for k, v in scalars(row).items():
                self.writer.add_scalar(k, v, step)

    def close(self):
        threading.excepthook = self.previous_hook
        if self.failed:
            return
        with self._writing():
            self.writer.close()  # joins the writer's thread: its error, if any, is known now
            if self.thread_error is not None:
                raise self.thread_error

    def _thread_died(self, args):
        if type(args.thread).__module__.startswith("tensorboard."):
            self.thread_error = args.exc_value
        else:
            self.previous_hook(args)

    @contextlib.contextmanager
    def _writing(self):
        """A failed write as files.writing says it (after it, log and close do nothing)."""
        try:
            with files.writing(self.where):
                yield
        except UserError:
            self.failed = True
            raise


class Wandb:
    """A wandb run; `run_id` continues a saved one (resume="allow")."""

    def __init__(self, name: str, config: dict, run_id: str | None):
        import wandb
        self.run = wandb.init(project=PROJECT, name=name, id=run_id, resume="allow",
                              config=config)
        self.id = self.run.id

    def log(self, row: dict, step: int):
        self.run.log(scalars(row), step=step)

    def close(self):
        self.run.finish()


class Trackio:
    """A Trackio run; resume="allow" continues the run of that name."""

    def __init__(self, name: str, config: dict):
        import trackio
        self.run = trackio.init(project=PROJECT, name=name, config=config, resume="allow",
                                embed=False)
        self.name = name

    def log(self, row: dict, step: int):
        self.run.log(scalars(row), step=step)

    def close(self):
        self.run.finish()


def open_all(cfg, start: int = 0, metrics_path: str | None = None) -> list:
    """The trackers --report-to names, opened on rank 0 (none elsewhere). A run that resumes
    (start > 0) continues the runs trackers.json names; --eval-only logs to runs of its own."""
    names = [n for n in cfg.report_to if n in PACKAGES]
    if distributed.rank() != 0 or not names:
        return []
    config, state_path = asdict(cfg), os.path.join(cfg.out_dir, "trackers.json")
    state = files.read_json(state_path) if start and os.path.isfile(state_path) else {}
    base = f"{os.path.basename(os.path.abspath(cfg.out_dir))}-{time.strftime('%Y%m%d-%H%M%S')}"
    name = base + "-eval" if cfg.eval_only else state.get("name", base)
    trackers = []
    if "tensorboard" in names:
        log_dir = os.path.join(cfg.out_dir, "tensorboard-eval" if cfg.eval_only else "tensorboard")
        if not start:  # a new run (--overwrite, another --eval-only): not the old one's curves
            shutil.rmtree(log_dir, ignore_errors=True)
        replay = [r for r in _rows(metrics_path) if r.get("step") == start] if start else []
        trackers.append(TensorBoard(log_dir, config, start or None, replay))
    if "wandb" in names:
        trackers.append(Wandb(name, config, None if cfg.eval_only else state.get("wandb_id")))
        state["wandb_id"] = trackers[-1].id
    if "trackio" in names:
        trackers.append(Trackio(name, config))
    if not cfg.eval_only:
        files.write_json(state_path, state | {"name": name})
    _open.extend(trackers)
    return trackers


def _rows(path: str | None) -> list[dict]:
    # a resume with nothing to do leaves metrics.jsonl as the crash did, a torn last line included
    return files.read_jsonl(path) if path and os.path.isfile(path) else []


def close(trackers: list):
    """Flush and close these trackers (each once)."""
    for tracker in trackers:
        if tracker in _open:
            _open.remove(tracker)
            tracker.close()


def close_all():
    """Flush and close every tracker still open (launch.session's end: a crash still flushes)."""
    close(list(_open))
