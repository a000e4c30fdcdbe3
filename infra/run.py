"""
The run around Algorithm 1: what dapo.py's loop does each step that is not the algorithm, behind
one object, so that train() reads as the paper's loop.

    run = Run(cfg, setup, opt, prompt_iter, generator)
                                  resumes from --resume's checkpoint (the trainer's state, and
                                  metrics.jsonl trimmed to it), or begins metrics.jsonl with the
                                  run's settings; opens the trackers of --report-to, the alarms
                                  and the Ctrl-C / SIGTERM handlers
    for step in run.steps():      the rollout steps left, each timed
    run.evaluation_due(step)      every --eval-every steps
    run.evaluated(step, result)   an evaluation's row; final=True also prints first -> last
    run.end_step(done, collected, trained)
                                  the step's row logged, its health checked (infra/health.py),
                                  a checkpoint saved on its cadence (--save-every, the last step,
                                  a stuck run, a stop asked for), then a stuck run raises
                                  RunStuck and a stopped one exits, saying how to resume
    run.check_trained()           a run that took no optimizer step raises RunStuck
    run.final_evaluation_due()    the evaluation at --steps (a resume at --steps makes it only if
                                  it was never logged)

report_eval() is --eval-only's: the result printed, written to eval.json and the trackers.
"""
import os
import time
from dataclasses import asdict

from infra import checkpoint, health, interrupt, metrics, trackers


class Run:
    """One training run's bookkeeping: its log, alarms, stop signals and checkpoints. cfg is
    dapo.py's Config; setup its launch.Setup (the policy, tokenizer, verifier, --resume's
    checkpoint); opt, prompt_iter and generator the state a checkpoint saves with the weights."""

    def __init__(self, cfg, setup, opt, prompt_iter, generator):
        self.cfg, self.setup, self.opt = cfg, setup, opt
        self.prompt_iter, self.generator = prompt_iter, generator
        self.metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl")
        self.start = 0 if not setup.resume_dir else checkpoint.resume(
            setup.resume_dir, setup.model, opt, prompt_iter, generator, self.metrics_path,
            cfg.steps, cfg.eval_every)
        if not self.start:  # a run that starts: its settings first, as the trackers get them
            metrics.log_settings(self.metrics_path, asdict(cfg))
        self.log = metrics.RunLog(self.metrics_path, self.start, cfg.steps,
                                  trackers.open_all(cfg, self.start, self.metrics_path))
        self.alarms = health.Alarms(cfg.stop_when_stuck, setup.verifier.spec)
        self.stop = interrupt.Stop()  # Ctrl-C, SIGTERM: the step finishes, is saved, then exits
        self.step_start = time.time()

    def steps(self):
        """The rollout steps still to take, 0-based, from the checkpoint's on a resume."""
        for step in range(self.start, self.cfg.steps):
            self.step_start = time.time()
            yield step

    def evaluation_due(self, step: int) -> bool:
        return bool(self.cfg.eval_every) and step % self.cfg.eval_every == 0

    def evaluated(self, step: int, result: dict, final: bool = False):
        """An evaluation's row, before rollout step `step`; the final one also prints how val/acc
        moved from the run's first evaluation."""
        self.log.evaluated(step, result)
        if final:
            self.log.say_eval_change(self.cfg.eval_samples)

    @property
    def last_val(self) -> dict | None:
        return self.log.last_val

    def end_step(self, done: int, collected, trained: dict):
        """After `done` steps (1-based): the row of the step (collected, a batch.Collected, and
        the update's metrics, `trained`) logged; the alarms; a checkpoint when it is due, the run
        is stuck or a stop was asked for (on any rank); then RunStuck or the exit."""
        cfg, setup = self.cfg, self.setup
        seconds, row = time.time() - self.step_start, collected.metrics | trained
        self.log.step(done, row, self.opt.param_groups[0]["lr"], collected.gen_s,
                      seconds - collected.gen_s)
        stuck = self.alarms.check(done, row, collected.generated, setup.tok,
                                  setup.verifier.take_errors())
        stopping = self.stop.requested()  # a collective: every rank asks
        if stuck or stopping or checkpoint.due(done, cfg.save_every, cfg.steps):
            checkpoint.save(cfg.out_dir, done, setup.model, setup.tok_dir, self.opt,
                            self.prompt_iter, self.generator, asdict(cfg),
                            keep_last=cfg.keep_checkpoints)
        if stuck:
            self.alarms.raise_stuck()
        if stopping:
            self.stop.exit(done)

    def check_trained(self):
        """A run that took no optimizer step trained nothing: RunStuck, a non-zero exit."""
        self.alarms.finish()

    def final_evaluation_due(self) -> bool:
        return checkpoint.final_evaluation_due(self.metrics_path, self.start, self.cfg.steps,
                                               self.cfg.eval_every)


def report_eval(result: dict, cfg):
    """--eval-only's result: printed, written to out_dir/eval.json beside the flags, and logged
    to the trackers of --report-to."""
    metrics.report_eval(result, cfg.out_dir, asdict(cfg), trackers.open_all(cfg))
