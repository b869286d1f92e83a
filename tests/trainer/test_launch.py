"""The local launcher (`paratrain run`), with stand-in ranks."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from paratrain import launch
from paratrain.api import apply_overrides, parse_job

from .harness import TINY_JOB, layout


class ProbeRank:
    """Stands in for a rank (launch.start_rank): at the moment it is started, someone must already listen on its
    MASTER_PORT, or another process could take that port before rank 0 binds it."""

    pid = -1

    def __init__(self, spec_file, env, log):
        with socket.create_connection((env["MASTER_ADDR"], int(env["MASTER_PORT"])), timeout=5):
            pass

    def poll(self) -> int:
        return 0

    def wait(self, timeout=None) -> int:
        return 0


def test_the_rendezvous_port_is_listened_on_before_any_rank_starts(monkeypatch, tmp_path):
    monkeypatch.setattr(launch, "start_rank", ProbeRank)
    job = parse_job(apply_overrides(TINY_JOB, layout(data=2)))
    assert launch.run_local(job, workdir=str(tmp_path), progress=False) == 0


def test_the_rank_that_died_is_reported_not_the_peer_that_saw_it():
    """A SIGKILLed rank 1 and rank 0's exit 75 (a peer failed) in the same poll: rank 1 is the cause."""
    assert launch.root_failure([75, -9]) == (1, -9)
    assert launch.root_failure([None, 75]) == (1, 75)  # alone, the peer failure is what there is to report
    assert launch.root_failure([2, 75, None]) == (0, 2)
    assert launch.root_failure([0, None]) is None


def test_a_forked_rank_has_its_own_session_and_log_and_stops_with_the_gang(tmp_path):
    """Ranks fork from the launcher's preloaded fork server: each still gets what exec gave it, a session of its
    own (so the stop reaches whatever it started) and its output in its log, and the gang's stop ends it."""
    job = parse_job(apply_overrides(TINY_JOB, layout(data=2) + ["spec.training.steps=100000"]))
    store = launch.RendezvousStore()
    procs = launch.start_gang(job, tmp_path, None, store.port)
    try:
        log = tmp_path / "logs" / "rank-0.log"  # rank 0 is the one that logs progress
        deadline = time.monotonic() + 120
        while "start step=0" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), log.read_text()
            time.sleep(0.2)
        assert "[rank 0] paratrain.progress INFO: start step=0" in log.read_text()
        assert [os.getsid(p.pid) for p in procs] == [p.pid for p in procs]
        assert [Path(f"/proc/{p.pid}/comm").read_text().strip() for p in procs] == ["paratrain-r0", "paratrain-r1"]
    finally:
        launch.stop_gang(procs)
        store.close()
    assert all(p.poll() is not None for p in procs)


def _ranks(*programs: str) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", program], start_new_session=True) for program in programs]


def _ctrl_c_every(seconds: float, times: int) -> threading.Thread:
    def press():
        for _ in range(times):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(seconds)

    thread = threading.Thread(target=press, daemon=True)
    thread.start()
    return thread


def test_ctrl_c_while_the_launcher_polls_its_ranks_always_stops_them(tmp_path):
    """A KeyboardInterrupt raised inside `Popen.poll()` could leave its wait lock held, and the stop then waited
    forever (a suite run hung 600 s there). Ctrl-C is a flag now: a burst of them, landing anywhere in the loop, ends
    in a stop that reaps every rank."""
    sleeper = "import time; time.sleep(120)"
    for _ in range(20):
        procs = _ranks(sleeper, sleeper)
        view = launch.ProgressView(tmp_path / "no-events.jsonl", live=False)
        with launch.CtrlC() as ctrl_c:
            presses = _ctrl_c_every(0.0005, 3)
            assert launch.watch_gang(procs, view, ctrl_c) == (-1, 130)
            presses.join()
        assert all(p.returncode is not None for p in procs)
        assert not any(p._waitpid_lock.locked() for p in procs)


def test_a_second_ctrl_c_kills_ranks_that_are_still_saving(tmp_path):
    """The first Ctrl-C gives the ranks SAVE_GRACE_SECONDS; a second one kills a rank that ignores SIGTERM now."""
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(120)"
    procs = [subprocess.Popen([sys.executable, "-c", stubborn], start_new_session=True, stdout=subprocess.PIPE)]
    procs[0].stdout.readline()  # its SIGTERM handler is in place
    view = launch.ProgressView(tmp_path / "no-events.jsonl", live=False)
    before, started = signal.getsignal(signal.SIGINT), time.monotonic()
    with launch.CtrlC() as ctrl_c:
        presses = _ctrl_c_every(1.0, 2)
        assert launch.watch_gang(procs, view, ctrl_c) == (-1, 130)
        presses.join()
    assert procs[0].returncode == -signal.SIGKILL
    assert time.monotonic() - started < launch.SAVE_GRACE_SECONDS / 2
    assert signal.getsignal(signal.SIGINT) is before  # restored


HOLD_THE_RUN = """
import json, sys, time
from pathlib import Path
from paratrain import launch
from paratrain.api import parse_job
with launch.one_run_at_a_time(parse_job(json.loads(sys.argv[1])), Path(sys.argv[2])):
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_second_run_in_a_live_runs_workdir_or_checkpoints_is_refused_naming_it(monkeypatch, tmp_path, capsys):
    """A sweep's second `paratrain run` of one job: refused while the first lives (its pid named), with the field
    to change; accepted once it has ended, however it ended (here SIGKILL: nothing left to clean up)."""
    import json

    from paratrain import cli

    ckpt = tmp_path / "ckpt"
    job = {**TINY_JOB, "spec": {**TINY_JOB["spec"], "checkpoint": {"path": str(ckpt), "interval": 5}}}
    job_file = tmp_path / "job.yaml"
    job_file.write_text(json.dumps(job))
    holder = subprocess.Popen([sys.executable, "-c", HOLD_THE_RUN, json.dumps(job), str(tmp_path / "first")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(launch, "start_rank", ProbeRank)
        assert cli.main(["run", str(job_file), "--workdir", str(tmp_path / "first"), "--no-progress"]) == 1
        said = capsys.readouterr().err
        assert "--workdir" in said and f"in use by a live run (pid {holder.pid}, job parity" in said, said
        assert cli.main(["run", str(job_file), "--workdir", str(tmp_path / "second"), "--no-progress"]) == 1
        said = capsys.readouterr().err
        assert f"spec.checkpoint.path: {ckpt} is in use by a live run (pid {holder.pid}" in said, said
        assert "--set spec.checkpoint.path=DIR" in said
    finally:
        holder.kill()
        holder.wait()
    assert cli.main(["run", str(job_file), "--workdir", str(tmp_path / "first"), "--no-progress"]) == 0


def test_an_fp32_cpu_job_is_checked_without_loading_torch():
    """Nothing to ask the device of an fp32 CPU job: the launcher (and `paratrain validate`) then leaves torch
    unloaded, seconds of CPU its ranks do not need it to spend (they have torch from their fork server)."""
    probe = ("import sys; from paratrain import launch; from paratrain.api import parse_job; "
             "from tests.trainer.harness import TINY_JOB; "
             "assert launch.device_problem(parse_job(TINY_JOB)) is None; "
             "assert 'torch' not in sys.modules, 'torch loaded'")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", probe], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_gpu_is_asked_about_the_precision_by_a_child_process(monkeypatch):
    """Issue 44: the launcher ran a bf16 op on cuda:0 itself, leaving a CUDA context on GPU 0 for the whole run
    (and failing on EXCLUSIVE_PROCESS GPUs). The question goes to a child now; its refusal names the field. (This
    machine has no GPU: the child's answer is a refusal, whatever it is, and this process never touches CUDA.)"""
    import torch

    from paratrain.train import entrypoint

    asked = []
    run = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda argv, **kw: asked.append(argv) or run(argv, **kw))
    monkeypatch.setattr(entrypoint, "device_type", lambda job: "cuda")
    problem = launch.device_problem(parse_job(apply_overrides(TINY_JOB, ["spec.precision=bf16"])))
    assert [argv[1:] for argv in asked] == [["-c", launch.CUDA_CHECK, "bf16", "0"]]
    assert problem is not None and problem.path in ("spec.precision", "spec.resources.gpusPerNode"), problem
    assert not torch.cuda.is_initialized()
    # The child's own refusal (exit 3, its message) becomes the problem, the field named:
    monkeypatch.setattr(launch, "CUDA_CHECK", "print('spec.precision: bf16 needs a GPU with bfloat16 support'); "
                                              "raise SystemExit(3)")
    said = launch.cuda_problem("bf16", False)
    assert (said.path, said.message) == ("spec.precision", "bf16 needs a GPU with bfloat16 support")


def test_what_the_device_cannot_run_is_refused_before_launch_naming_the_field(monkeypatch):
    import torch

    from paratrain.train.parallel import precision

    monkeypatch.delenv("PARATRAIN_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    gpu_job = parse_job(apply_overrides(TINY_JOB, ["spec.resources.gpusPerNode=1"]))
    assert launch.device_problem(gpu_job).path == "spec.resources.gpusPerNode"

    monkeypatch.setattr(precision, "cpu_has_native_fp16", lambda: False)
    deepspeed_fp16 = parse_job(apply_overrides(TINY_JOB, layout(data=2, zeroStage=2) + ["spec.precision=fp16"]))
    problem = launch.device_problem(deepspeed_fp16)
    assert problem.path == "spec.precision" and "native fp16" in problem.message
    assert launch.device_problem(parse_job(apply_overrides(TINY_JOB, ["spec.precision=bf16"]))) is None
