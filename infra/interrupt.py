"""
Ctrl-C (SIGINT) and a scheduler's SIGTERM (Slurm's or Kubernetes' preemption, which gives a grace
period before SIGKILL): the run finishes the step in progress, saves a checkpoint, prints the
command that resumes it and exits 130 (Ctrl-C) or 143 (SIGTERM), the shells' 128 + the signal's
number. A second Ctrl-C stops at once, losing the step in progress.

    stop = Stop()           the handlers, from the start of the training loop to the end of the
                            run (launch.session calls restore())
    stop.requested()        at the end of each step, on every rank: a signal reached some rank
    stop.exit(step)         after that step's checkpoint: says how to resume, and exits

Why at the end of a step, not at once: a step is what a checkpoint holds (the weights after its
update, the data position and the random states after its draws), and under FSDP one rank cannot
leave the others' collectives alone. A step that outlasts the grace period is cut short by the
SIGKILL that follows, as without this; --save-every bounds what that loses. Under torchrun, which
forwards the signal to every rank, the ranks agree at each step's end (one all-reduce), so all
save together even when the signal reached only some (one node preempted).
"""
import os
import shlex
import signal
import sys
import threading

from infra import distributed

NAMES = {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM"}
_previous: dict = {}  # the handlers Stop replaced, which restore() puts back


class Stop:
    """A stop asked for by SIGINT or SIGTERM, honoured at the end of the step in progress."""

    def __init__(self):
        self.signum = 0  # the first signal received (or agreed from another rank); 0: none
        if threading.current_thread() is not threading.main_thread():
            return  # Python runs handlers in the main thread only: elsewhere, the defaults
        for signum in NAMES:
            _previous.setdefault(signum, signal.signal(signum, self._received))

    def _received(self, signum, frame):
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            _say("a second Ctrl-C: stopping at once (the step in progress is lost)")
            raise KeyboardInterrupt
        if not self.signum:  # a second SIGTERM (torchrun forwards the scheduler's) changes nothing
            self.signum = signum
            _say(f"{NAMES[signum]}: stopping at the end of the step in progress, with a "
                 "checkpoint" + (" (Ctrl-C again: at once)" if signum == signal.SIGINT else ""))

    def requested(self) -> bool:
        """Whether a signal reached this rank or another (on every rank: a collective)."""
        self.signum = int(distributed.all_reduce(self.signum, "max", name="stop requested"))
        return bool(self.signum)

    def exit(self, step: int):
        """After checkpoint `step` is saved: the line that says how to resume, then SystemExit
        with 128 + the signal's number, the shells' status of a process the signal stopped."""
        distributed.say(f"{NAMES[self.signum]}: stopped after step {step}, its checkpoint "
                        f"saved. To resume: {resume_command(sys.argv)}")
        raise SystemExit(128 + self.signum)


def resume_command(argv: list[str]) -> str:
    """The command line that continues this run: argv with --resume, without --overwrite (and
    under torchrun, its own flags to be filled in)."""
    flags = [a for a in argv[1:] if a not in ("--resume", "--no-resume", "--overwrite")]
    launcher = "torchrun [its flags]" if distributed.launched_world() > 1 else "python"
    return f"{launcher} {shlex.join([argv[0], *flags, '--resume'])}"


def restore():
    """Put back the handlers Stop replaced (the end of a run: a test or a notebook goes on)."""
    for signum, handler in _previous.items():
        signal.signal(signum, handler)
    _previous.clear()


def _say(text: str):
    """A line from a signal handler, on rank 0: os.write, as a print interrupted by the signal
    cannot be re-entered."""
    if distributed.launched_rank() == 0:
        os.write(2, f"\n{text}\n".encode())  # stderr
