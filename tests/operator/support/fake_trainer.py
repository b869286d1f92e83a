"""A stand-in trainer for operator tests that do not need torch (the test kubelet runs it instead of torchrun).

It speaks the real trainer's operator-facing contract: rank 0 serves `GET /progress` on $POD_IP:$PARATRAIN_
PROGRESS_PORT with the same JSON, the exit code says success (0) or the kind of failure, and rank 0 writes its
final progress to $PARATRAIN_TERMINATION_LOG when set. Behaviour comes from the pod's env (spec.pod.env):

    FAKE_STEPS=5            steps to "train"
    FAKE_STEP_SECONDS=0.2   time per step
    FAKE_STALL_AFTER=N      stop advancing after step N (keep serving progress): a stalled job
    FAKE_EXIT_CODE=C        exit with C...
    FAKE_EXIT_STEP=N        ...after step N (default: the last)...
    FAKE_EXIT_RANK=R        ...on node rank R only (default: every rank)...
    FAKE_FAIL_ATTEMPTS=K    ...only while PARATRAIN_RESTART_ATTEMPT < K (a failure the gang restart cures)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def main() -> int:
    env = os.environ
    rank = int(env.get("PET_NODE_RANK", "0"))
    attempt = int(env.get("PARATRAIN_RESTART_ATTEMPT", "0"))
    steps, step_seconds = int(env.get("FAKE_STEPS", "5")), float(env.get("FAKE_STEP_SECONDS", "0.2"))
    stall_after = int(env.get("FAKE_STALL_AFTER", str(steps + 1)))
    exit_code = int(env.get("FAKE_EXIT_CODE", "0"))
    if env.get("FAKE_EXIT_RANK") not in (None, str(rank)) or attempt >= int(env.get("FAKE_FAIL_ATTEMPTS", "99")):
        exit_code = 0
    exit_step = int(env.get("FAKE_EXIT_STEP", str(steps))) if exit_code else steps
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    progress = {"step": 0, "totalSteps": steps, "loss": None, "valLoss": None, "tokensPerSecond": 0.0,
                "etaSeconds": None, "updatedAt": _now(), "phase": "starting"}
    if rank == 0 and env.get("PARATRAIN_PROGRESS_PORT"):
        _serve(progress, env.get("POD_IP", "127.0.0.1"), int(env["PARATRAIN_PROGRESS_PORT"]))
    step = 0
    while step < steps:
        if step >= exit_step:
            print(f"fake trainer rank {rank} attempt {attempt}: failing at step {step} with {exit_code}", flush=True)
            return exit_code
        time.sleep(step_seconds)
        if step >= stall_after:
            continue
        step += 1
        progress.update(step=step, loss=round(4.0 / step, 4), tokensPerSecond=1000.0, phase="training",
                        etaSeconds=round((steps - step) * step_seconds, 3), updatedAt=_now())
    progress.update(phase="done", etaSeconds=0.0, valLoss=1.5, updatedAt=_now())
    if rank == 0 and env.get("PARATRAIN_TERMINATION_LOG"):
        with open(env["PARATRAIN_TERMINATION_LOG"], "w") as f:
            json.dump(progress, f)
    print(f"fake trainer rank {rank} attempt {attempt}: {steps} steps, exit {exit_code}", flush=True)
    return exit_code


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def json_handler(answer: Callable[[BaseHTTPRequestHandler], Any]) -> type[BaseHTTPRequestHandler]:
    """A handler answering every GET with `answer(request)` as JSON (rank 0's progress endpoint; the hollow nodes'
    serves every hollow pod with it)."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = json.dumps(answer(self)).encode()
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the reader gave up (its timeout)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass
    return Handler


def _serve(progress: dict, host: str, port: int) -> None:
    server = ThreadingHTTPServer((host, port), json_handler(lambda request: progress))
    threading.Thread(target=server.serve_forever, daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
