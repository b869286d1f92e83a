"""Progress for a training program of your own (spec.entrypoint), reported as the built-in trainer reports it.

    from paratrain.progress import Progress

    with Progress(total_steps=1000) as progress:      # every rank may call it; only rank 0 reports
        for step in range(start, 1000):
            ...
            progress.step(step + 1, loss=loss.item(), tokens=tokens_this_step)
            progress.eval(step + 1, val_loss)         # now and then

Rank 0 then serves `GET /progress` on $PARATRAIN_PROGRESS_PORT (the operator reads Step, Loss, tokens/s and the ETA
into the job's status, and the Stalled condition from `updatedAt`), writes its final report to
$PARATRAIN_TERMINATION_LOG (the pod's termination message, read after the pod exits), and appends events to
$PARATRAIN_EVENTS_FILE (`paratrain run`'s progress line). All of it is optional: a program that reports nothing
trains the same, but its Step and Loss stay empty and, silence reading as no progress, the job turns Stalled (a
condition; it keeps running) after runPolicy.stallTimeoutSeconds.

A program in another language reports the same by serving `GET /progress` itself: a JSON object with step,
totalSteps, loss, valLoss, tokensPerSecond, etaSeconds, updatedAt (ISO 8601) and phase (starting, training, done),
as `paratrain.api.status.Progress` reads it.
"""

from __future__ import annotations

import os
import time
from types import TracebackType

from . import contract
from .train.progress import ProgressReporter


class Progress:
    """Rank 0's reporter; on every other rank each call does nothing."""

    def __init__(self, total_steps: int, start_step: int = 0):
        self.total_steps, self._start_step = total_steps, start_step
        self._started = self._last_time = time.monotonic()
        self._reporter: ProgressReporter | None = None
        if int(os.environ.get("RANK", "0")) == 0:
            port = os.environ.get(contract.ENV_PROGRESS_PORT)
            self._reporter = ProgressReporter(total_steps, os.environ.get(contract.ENV_EVENTS_FILE),
                                              os.environ.get(contract.ENV_PROGRESS_HOST), int(port) if port else None)
            self._reporter.emit("start", step=start_step, totalSteps=total_steps)

    def step(self, step: int, loss: float, tokens: int = 0) -> None:
        """Optimizer step `step` (1-based: steps done so far) ended with `loss`, having processed `tokens` tokens."""
        if self._reporter is None:
            return
        now = time.monotonic()
        elapsed, done = now - self._started, step - self._start_step
        rate = done / elapsed if done > 0 and elapsed > 0 else 0.0
        seconds, self._last_time = now - self._last_time, now
        self._reporter.emit("step", step=step, totalSteps=self.total_steps, loss=float(loss),
                            tokensPerSecond=tokens / seconds if seconds > 0 else 0.0,
                            etaSeconds=(self.total_steps - step) / rate if rate else None)

    def eval(self, step: int, val_loss: float) -> None:
        if self._reporter is not None:
            self._reporter.emit("eval", step=step, valLoss=float(val_loss))

    def close(self) -> None:
        """Training ended: the final report (phase done) becomes the pod's termination message."""
        if self._reporter is not None:
            last = self._reporter.get()
            self._reporter.emit("done", step=last["step"], totalSteps=self.total_steps)
            self._reporter.close()
            self._reporter = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if kind is None:
            self.close()
        elif self._reporter is not None:  # failed: stop serving, but a failed run is not "done"
            self._reporter.close()
            self._reporter = None
