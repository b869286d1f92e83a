"""A SIGTERM (a node drain, a Kueue preemption, runPolicy.suspend, `paratrain run` stopped) as a request to stop at
the next step boundary with a checkpoint, instead of dying mid-step and losing everything since the last one.

The signal reaches one rank or all of them; the ranks agree on it in the all-reduce every step already makes
(loop.mean_over_reporters: no collective of its own), so all of them save the same step together, then exit with
contract.EXIT_PREEMPTED, which the operator does not count against backoffLimit.
"""

from __future__ import annotations

import logging
import signal

log = logging.getLogger("paratrain.preemption")


class Preempted(Exception):
    """Raised out of the training loop once the checkpoint of `step` is written (or there is none to write)."""

    def __init__(self, step: int, saved: bool):
        super().__init__(step)
        self.step, self.saved = step, saved


class StopRequest:
    """Set by SIGTERM; the loop reads it at every step boundary."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        if not self.requested:
            log.warning("SIGTERM: stopping after this step with a checkpoint")
        self.requested = True
