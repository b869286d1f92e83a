"""Rank 0's progress reports: one JSON line per event to a file (the local launcher's progress bar reads it), a
log line, and `GET /progress` over HTTP (the operator polls it, so pods need no API credentials)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from .. import contract

log = logging.getLogger("paratrain.progress")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# Event field → TensorBoard tag, per event; scalars only, at the event's step (the performance summary: the last).
TENSORBOARD_TAGS = {
    "step": {"loss": "train/loss", "lr": "train/learning_rate", "gradNorm": "train/grad_norm",
             "tokensPerSecond": "perf/tokens_per_second"},
    "eval": {"valLoss": "val/loss"},
    "done": {"valLoss": "val/loss"},  # the final evaluation is reported with the end of training
    "performance": {"mfu": "perf/mfu", "modelFlopsPerToken": "perf/model_flops_per_token",
                    "achievedFlopsPerSecond": "perf/achieved_flops_per_second",
                    "peakMemoryBytes": "memory/peak_bytes"},
}


class TensorBoardWriter:
    """The reporter's events as TensorBoard scalars in `log_dir` (spec.logging.tensorboard)."""

    def __init__(self, log_dir: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # torch's module needs the tensorboard package for its event-file writer
            raise ValueError(f"spec.logging.tensorboard: writing event files needs the tensorboard package "
                             f"({exc}); pip install tensorboard") from None
        self._writer = SummaryWriter(log_dir=log_dir)
        self._step = 0

    def write(self, event: str, fields: dict) -> None:
        self._step = fields.get("step", self._step)
        for name, tag in TENSORBOARD_TAGS.get(event, {}).items():
            value = fields.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(tag, value, self._step)

    def close(self) -> None:
        self._writer.close()


class ProgressReporter:
    def __init__(self, total_steps: int, events_file: str | None = None, host: str | None = None,
                 port: int | None = None, tensorboard: TensorBoardWriter | None = None):
        self.snapshot: dict = {"phase": "starting", "step": 0, "startStep": None, "totalSteps": total_steps,
                               "loss": None, "valLoss": None, "tokensPerSecond": 0.0, "etaSeconds": None,
                               "peakMemoryBytes": None, "updatedAt": _now()}
        self._lock = threading.Lock()
        self._events = open(events_file, "a", buffering=1) if events_file else None
        self._server = _serve(self, host or "0.0.0.0", port) if port else None
        self._tensorboard = tensorboard

    def emit(self, event: str, **fields) -> None:
        with self._lock:
            if event in ("step", "eval", "start", "done"):
                self.snapshot.update({k: v for k, v in fields.items() if k in self.snapshot})
                self.snapshot["phase"] = {"done": "done"}.get(event, "training")
                self.snapshot["updatedAt"] = _now()
        record = {"event": event, "time": time.time(), **fields}
        if self._events:
            self._events.write(json.dumps(record) + "\n")
        if self._tensorboard:
            self._tensorboard.write(event, fields)
        if event != "step" or fields.get("log", False):
            log.info("%s %s", event, " ".join(f"{k}={v}" for k, v in fields.items() if k != "log"))

    def restarted(self, count: int, failure: dict) -> None:
        """This is round `count` of in-place restarts, after `failure` ({rank, nodeRank, exitCode}): in every
        report from now on, for the operator to count and name."""
        with self._lock:
            self.snapshot.update(restartsInPlace=count, lastFailure=failure)
        self.emit("restart", restartsInPlace=count, lastFailure=failure)

    def get(self) -> dict:
        with self._lock:
            return dict(self.snapshot)

    def close(self) -> None:
        # The final report outlives the process as the pod's termination message (read by the operator).
        write_termination_message(self.get())
        if self._server:
            self._server.shutdown()
            self._server.server_close()
        if self._events:
            self._events.close()
        if self._tensorboard:
            self._tensorboard.close()


def _serve(reporter: ProgressReporter, host: str, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.rstrip("/") not in ("/progress", "/healthz"):
                self.send_error(404)
                return
            body = json.dumps(reporter.get()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # quiet: the operator polls often
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="progress-http", daemon=True).start()
    return server


def write_json(path: str, data: dict) -> None:
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def write_termination_message(report: dict) -> None:
    """`report` as the pod's termination message ($PARATRAIN_TERMINATION_LOG; unset outside a pod), which the
    operator reads once the pod has exited: the final progress, or {"error": ...} when the trainer refuses the job."""
    termination_log = os.environ.get(contract.ENV_TERMINATION_LOG)
    if termination_log:
        try:
            Path(termination_log).write_text(json.dumps(report))
        except OSError as exc:
            log.warning("cannot write the termination message to %s: %s", termination_log, exc)
