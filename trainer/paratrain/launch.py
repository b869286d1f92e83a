"""`paratrain run`: a job's whole gang as local processes, each with the worker env torchrun gives pods' workers,
meeting at a rendezvous store hosted for them, as torchrun's agent hosts it. The ranks and the store's host fork
from a fork server that imported the trainer once (start_rank).

Shows a live progress line read from rank 0's event file, prints a summary, and if any rank fails stops the
others and exits with that rank's code.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import yaml

from . import contract
from .api import ParallelTrainJob, Problem, SpecError, describe_checkpoints, describe_layout, hardware, parse_job, \
    planner
from .api.memory import human
from .token_shards import TokenDirError, open_token_dir

CAUSE_WAIT_SECONDS = 3.0  # how long a rank's exit 75 (a peer failed) waits for the peer's own exit to name it
STOP_GRACE_SECONDS = 5.0  # ranks left after another one failed: their gang is broken, nothing to save
SAVE_GRACE_SECONDS = 30.0  # Ctrl-C: the ranks save the step in flight first (train.preemption)


class RendezvousStore:
    """The gang's TCPStore, hosted for it as torchrun's agent hosts it for a pod's workers (the workers'
    TORCHELASTIC_USE_AGENT_STORE makes every rank a client). It listens on a port the kernel picks when it binds, so
    no other process can take the port between choosing it and listening on it, as with a port chosen first and
    bound later by rank 0. Its host is a process forked like the ranks (start_rank), so the launcher itself never
    loads torch; it serves until `close()`, or until the launcher is gone."""

    def __init__(self, timeout: float = 120.0):
        context = fork_context()
        self._ours, theirs = context.Pipe()
        self._host = context.Process(target=_host_store, args=(theirs,), name="rendezvous-store")
        self._host.start()
        theirs.close()
        if not self._ours.poll(timeout):
            self.close()
            raise RuntimeError(f"the rendezvous store did not start listening in {timeout:.0f} s")
        self.port: int = self._ours.recv()

    def close(self) -> None:
        self._ours.close()  # the host's recv() ends: it exits
        self._host.join(5)
        if self._host.exitcode is None:
            self._host.kill()
            self._host.join()

    def __enter__(self) -> RendezvousStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _host_store(launcher) -> None:
    os.setsid()  # a terminal's Ctrl-C is the launcher's to handle: the ranks still reach the store as they save
    name_process("paratrain-store")
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    launcher.send(store.port)
    with contextlib.suppress(EOFError):
        launcher.recv()
    os._exit(0)


def _threads_per_rank(world: int) -> str:
    return os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // world))


def start_gang(job: ParallelTrainJob, workdir: Path, metrics_out: str | None, port: int,
               peak_flops: float | None = None, measure_memory: bool = False) -> list[RankProcess]:
    """Every rank as a process, meeting at the rendezvous store on `port`."""
    spec = job.spec
    spec_file = workdir / contract.SPEC_FILE_NAME
    spec_file.write_text(yaml.safe_dump(job.dump(), sort_keys=False))
    (workdir / "logs").mkdir(exist_ok=True)
    events = workdir / "events.jsonl"
    events.unlink(missing_ok=True)
    procs = []
    for rank in range(spec.world_size):
        env = {**os.environ, **contract.worker_env(rank=rank, nnodes=spec.nodes, nproc_per_node=spec.procs_per_node,
                                                  master_addr="127.0.0.1", master_port=port)}
        env["OMP_NUM_THREADS"] = _threads_per_rank(spec.world_size)
        env[contract.ENV_JOB_NAME] = job.metadata.name
        if peak_flops is not None:
            env[contract.ENV_PEAK_FLOPS] = repr(peak_flops)
        if measure_memory:
            env[contract.ENV_MEASURE_MEMORY] = "1"
        if rank == 0:
            env[contract.ENV_EVENTS_FILE] = str(events)
            if metrics_out:
                env[contract.ENV_METRICS_OUT] = str(Path(metrics_out).resolve())
        procs.append(start_rank(spec_file, env, workdir / "logs" / f"rank-{rank}.log"))
    return procs


# What every rank imports before its first step: about 7 s of CPU (torch alone 3.5), paid once per launcher by
# its fork server instead of once per rank.
RANK_MODULES = ["paratrain.train.entrypoint", "paratrain.train.build", "paratrain.train.checkpoint",
                "paratrain.train.loop", "paratrain.train.preflight", "torch._dynamo"]


class RankProcess:
    """A rank forked from the launcher's fork server (multiprocessing's), with the part of Popen's interface the
    launcher uses: pid, poll(), wait()."""

    def __init__(self, process):
        self._process = process
        self.pid = process.pid

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired("rank", timeout)
        return self._process.exitcode


def start_rank(spec_file: Path, env: dict[str, str], log: Path) -> RankProcess:
    """One rank, `paratrain train --spec SPEC` as a pod's worker runs it, in its own session with `env`, its output
    in `log`. Forked from a server that has imported the trainer's modules (RANK_MODULES) and done nothing else: no
    torch op (a fork after OpenMP ran can hang the child's first parallel region) and no CUDA call (CUDA does not
    survive a fork), so GPU ranks fork from it too."""
    process = fork_context().Process(target=_rank_main, args=(str(spec_file), env, str(log)), name=log.stem)
    process.start()
    return RankProcess(process)


def fork_context():
    """multiprocessing's fork server, started on first use with RANK_MODULES imported: the ranks and their store's
    host fork from it (and, in a pod, `paratrain node`'s workers)."""
    import multiprocessing
    import multiprocessing.forkserver

    multiprocessing.forkserver.set_forkserver_preload(RANK_MODULES)
    return multiprocessing.get_context("forkserver")


def _rank_main(spec_file: str, env: dict[str, str], log: str) -> None:
    """The forked rank: what exec would have given it (a new session, the env, stdout and stderr in the log,
    no terminal input), then the trainer."""
    os.setsid()
    name_process(f"paratrain-r{env['RANK']}")
    with open(log, "wb") as out, open(os.devnull, "rb") as nothing:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        os.dup2(nothing.fileno(), 0)
    os.environ.clear()
    os.environ.update(env)
    use_own_threads()
    from .train.entrypoint import exit_now, train_main

    exit_now(train_main(spec_file))


def use_own_threads() -> None:
    """In a forked rank: the threads its OMP_NUM_THREADS asks for. OpenMP read the variable when the fork server
    loaded it, from the launcher's environment, not this rank's (its first level, as OpenMP reads a nested "4,2")."""
    import torch

    threads = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def name_process(name: str) -> None:
    """The name `top`, `ps -o comm` and `pgrep` show (Linux's comm, 15 bytes): a forked process's command line is
    its fork server's, which says nothing of which rank it is."""
    with contextlib.suppress(OSError):
        Path("/proc/self/comm").write_text(name[:15])


def start_program(job: ParallelTrainJob, workdir: Path, port: int) -> list[subprocess.Popen]:
    """A job with its own spec.entrypoint: its command once per node, with the env a pod gets (torchrun's PET_*
    flags, so `torchrun train.py` needs none; the layout; the progress events file), in its workingDir or here."""
    spec, entrypoint = job.spec, job.spec.entrypoint
    assert entrypoint is not None
    (workdir / "logs").mkdir(exist_ok=True)
    events = workdir / "events.jsonl"
    events.unlink(missing_ok=True)
    # The program's own tools (torchrun, python) from the environment paratrain runs in, as the image's would be.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    procs = []
    for node in range(spec.nodes):
        env = {**os.environ, "PATH": path, "OMP_NUM_THREADS": _threads_per_rank(spec.world_size),
               **contract.node_env(nnodes=spec.nodes, nproc_per_node=spec.procs_per_node, node_rank=node,
                                   master_addr="127.0.0.1", master_port=port),
               **contract.layout_env(spec.parallelism, spec.precision),
               contract.ENV_JOB_NAME: job.metadata.name, contract.ENV_RESTART_ATTEMPT: "0",
               contract.ENV_EVENTS_FILE: str(events)}
        out = open(workdir / "logs" / f"node-{node}.log", "w")
        try:
            procs.append(subprocess.Popen([*entrypoint.command, *entrypoint.args], env=env, stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True,
                                          cwd=entrypoint.working_dir))
        except OSError as exc:
            stop_gang(procs)
            raise SpecError([Problem("spec.entrypoint.command", f"cannot start {entrypoint.command[0]!r}: "
                                     f"{exc.strerror or exc}")]) from None
    return procs


def free_port() -> int:
    """A port nothing listens on now, for node 0's torchrun to host the rendezvous store on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def stop_gang(procs: list[RankProcess | subprocess.Popen], grace: float = STOP_GRACE_SECONDS,
              hurry: Callable[[], bool] = lambda: False) -> None:
    """SIGTERM every live rank, SIGKILL what is left after a grace period (or at once when `hurry()` turns true:
    a second Ctrl-C): nothing is left behind."""
    for p in procs:
        if p.poll() is None:
            _signal_session(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline and not hurry():
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            _signal_session(p.pid, signal.SIGKILL)
            p.wait()


def _signal_session(pid: int, signum: int) -> None:
    """Signal a rank and whatever it started (its session's process group). A rank forked a moment ago may not
    have made its session yet: then the rank alone."""
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


class CtrlC:
    """SIGINT as a count the launcher's loops read, instead of a KeyboardInterrupt raised between any two
    bytecodes: one raised inside `Popen.poll()` can leave the Popen's wait lock held (CPython acquires it before
    its try block), and the stop's `wait()` then blocks forever. Restores the previous handler on exit."""

    def __init__(self) -> None:
        self.count = 0

    def __enter__(self) -> CtrlC:
        # Only the main thread may set handlers; elsewhere (a launcher called from a thread) Ctrl-C stays as it was.
        main = threading.current_thread() is threading.main_thread()
        self._previous = signal.signal(signal.SIGINT, self._pressed) if main else None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _pressed(self, signum: int, frame: object) -> None:
        self.count += 1


def watch_gang(procs: list[RankProcess | subprocess.Popen], view: ProgressView,
               ctrl_c: CtrlC) -> tuple[int, int] | None:
    """Follow the gang until a rank fails (its rank and exit code), all succeed (None) or Ctrl-C ((-1, 130)); what
    is still running is stopped either way. Ctrl-C gives the ranks SAVE_GRACE_SECONDS to save the step in flight,
    a second one kills them at once."""
    failed, consequence_seen = None, None
    try:
        while not ctrl_c.count:
            view.poll()
            codes = [p.poll() for p in procs]
            failed = root_failure(codes)
            if failed and failed[1] == contract.EXIT_RETRYABLE and None in codes:
                # A peer's exit 75 can come before its cause's own exit (which logs its error first): wait a little.
                consequence_seen = consequence_seen or time.monotonic()
                if time.monotonic() - consequence_seen < CAUSE_WAIT_SECONDS:
                    time.sleep(0.2)
                    continue
            if failed or all(c == 0 for c in codes):
                break
            time.sleep(0.2)
    finally:
        if ctrl_c.count:
            print(f"\nparatrain: stopping: the ranks save the step in flight first (up to {SAVE_GRACE_SECONDS:.0f} s;"
                  " Ctrl-C again to kill them now)", file=sys.stderr)
            stop_gang(procs, SAVE_GRACE_SECONDS, hurry=lambda: ctrl_c.count > 1)
        else:
            stop_gang(procs, STOP_GRACE_SECONDS)
    return (-1, 130) if ctrl_c.count else failed


class ProgressView:
    """Follows rank 0's events file; draws one updating line on a terminal, plain lines elsewhere."""

    def __init__(self, events: Path, live: bool):
        self.events, self.live, self.offset = events, live, 0
        self.last: dict = {}
        self.val_loss: float | None = None
        self._last_plain = 0.0

    def poll(self) -> None:
        if not self.events.exists():
            return
        with open(self.events) as f:
            f.seek(self.offset)
            for line in f:
                if not line.endswith("\n"):
                    break  # a line still being written: read it next time
                self.offset += len(line)
                self._handle(json.loads(line))

    def _handle(self, ev: dict) -> None:
        kind = ev["event"]
        if kind == "step":
            self.last = ev
            self._draw()
        elif kind == "eval":
            self.val_loss = ev["valLoss"]
            self._print(f"step {ev['step']}: val loss {ev['valLoss']:.4f}")
        elif kind in ("resume", "checkpoint"):
            self._print(f"{kind} at step {ev['step']}")
        elif kind == "note":
            self._print(f"note: {ev['message']}")

    def _print(self, text: str) -> None:
        if self.live:
            sys.stderr.write("\r\033[K" + text + "\n")
            self._draw()  # the bar goes back under the message
        else:
            sys.stderr.write(text + "\n")

    def _draw(self) -> None:
        ev = self.last
        if not ev:
            return
        step, total = ev["step"], ev["totalSteps"]
        width = 24
        filled = int(width * step / total)
        line = (f"[{'#' * filled}{'.' * (width - filled)}] step {step}/{total}  loss {ev['loss']:.4f}  "
                f"{ev['tokensPerSecond']:,.0f} tok/s  ETA {_duration(ev['etaSeconds'])}")
        if self.live:
            sys.stderr.write("\r\033[K" + line)
            sys.stderr.flush()
        elif time.monotonic() - self._last_plain > 10 or step == total:
            self._last_plain = time.monotonic()
            sys.stderr.write(line + "\n")

    def finish(self) -> None:
        self.poll()
        if self.live and self.last:
            sys.stderr.write("\n")


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def missing_data(job: ParallelTrainJob, volumes: Mapping[str, Path] | None = None) -> Problem | None:
    """The corpus (a text file, a token directory) when it is not on this machine, saying where it was looked for
    and how to point there: `volumes` (map_volumes': volume name → local directory) for a path under a volume."""
    data = job.spec.data
    if data.source == "synthetic" or not data.path:
        return None
    path = Path(data.path)
    if path.is_file() if data.source == "text" else path.is_dir():
        return None
    what = "file" if data.source == "text" else "directory"
    spec_volumes = {v.name: v for v in job.spec.pod.volumes}
    under = next((name for name, local in (volumes or {}).items() if path.is_relative_to(local)), None)
    if under:
        mount = spec_volumes[under].mount_path
        how = (f"it is on volume {under} ({mount} in pods), which this run maps to {volumes[under]}: put the data "
               f"there, or run with --mount {under}=DIR, DIR the directory that holds it here")
    elif path.is_absolute():
        how = "an absolute path on this machine; in pods it must be on a spec.pod.volumes entry or in the image"
    else:
        how = "a relative path is relative to the current directory"
    return Problem("spec.data.path", f"{data.path}: no such {what} (looked for {path.resolve()}; {how})")


def data_vocab(job: ParallelTrainJob) -> int | None:
    """The vocabulary the job's model gets: the synthetic source's `spec.model.vocabSize`, a token directory's
    manifest, a text file's characters (read here, as a rank would); None where the data is not on this machine."""
    from .train.data import load_corpus

    d, m = job.spec.data, job.spec.model
    if missing_data(job):
        return None
    return load_corpus(d.source, d.path, d.val_fraction, m.vocab_size, job.spec.training.seed,
                       m.block_size).vocab_size


def broken_data(job: ParallelTrainJob, checksums: bool = True) -> list[Problem]:
    """What is wrong with a token directory on this machine: an unfinished prepare, or shards missing, of the wrong
    size or (with `checksums`) changed. Hashes every shard (a few seconds per GB), which ranks do not: they check
    sizes only."""
    data = job.spec.data
    if data.source != "tokens" or not data.path or not Path(data.path).is_dir():
        return []
    try:
        open_token_dir(Path(data.path), checksums=checksums)
    except TokenDirError as exc:
        return [Problem("spec.data.path", f"{data.path}: {problem}") for problem in exc.problems]
    return []


def init_problem(job: ParallelTrainJob) -> Problem | None:
    """`spec.model.init` when it is not a Hugging Face directory of this spec's model on this machine (the vocabulary
    is checked where known before the data is read: the synthetic source's)."""
    from .train.models.hf_config import init_problem as problem_of

    model = job.spec.model
    vocab_size = model.vocab_size if job.spec.data.source == "synthetic" else None
    problem = problem_of(model, vocab_size) if model.init else None
    return Problem("spec.model.init", problem) if problem else None


# The spec's paths a pod reads or writes: under a volume's mountPath in a cluster.
PATH_FIELDS = (("data", "path"), ("checkpoint", "path"), ("logging", "tensorboard"), ("model", "init"))


def volume_of(path: str, job: ParallelTrainJob):
    """The spec.pod.volumes entry whose mountPath holds the absolute `path` (the longest), or None."""
    holders = [v for v in job.spec.pod.volumes
               if path == v.mount_path or path.startswith(v.mount_path.rstrip("/") + "/")]
    return max(holders, key=lambda v: len(v.mount_path), default=None)


def map_volumes(job: ParallelTrainJob, workdir: Path, mounts: list[str],
                create: bool = True) -> tuple[ParallelTrainJob, dict[str, Path]]:
    """The job as a local run sees it: each spec.pod.volumes entry is a local directory (`--mount NAME=DIR`, else
    WORKDIR/volumes/NAME, created), and every spec path under a volume's mountPath points into that directory, so a
    cluster-shaped job (/data, /checkpoints) runs here unchanged. Returns the job and volume name → directory."""
    names = [v.name for v in job.spec.pod.volumes]
    chosen: dict[str, str] = {}
    for mount in mounts:
        name, sep, directory = mount.partition("=")
        if not sep or not directory:
            raise SpecError([Problem("--mount", f"{mount!r} is not NAME=DIR")])
        if name not in names:
            known = ", ".join(names) or "none"
            raise SpecError([Problem("--mount", f"no volume {name!r} in spec.pod.volumes (it has: {known})")])
        chosen[name] = directory
    local = {v.name: Path(chosen.get(v.name) or workdir / "volumes" / v.name).resolve() for v in job.spec.pod.volumes}
    if not local:
        return job, local
    doc = job.dump()

    def localise(value: str) -> str:
        volume = volume_of(value, job) if value.startswith("/") else None
        if not volume:
            return value
        rest = value[len(volume.mount_path):].lstrip("/")
        return str(local[volume.name] / rest) if rest else str(local[volume.name])

    for section, field in PATH_FIELDS:
        if value := doc["spec"].get(section, {}).get(field):
            doc["spec"][section][field] = localise(value)
    if entrypoint := doc["spec"].get("entrypoint"):  # a program's paths under a mount, e.g. /checkpoints/run
        for key in ("command", "args"):
            entrypoint[key] = [localise(arg) for arg in entrypoint.get(key, [])]
        if entrypoint.get("workingDir"):
            entrypoint["workingDir"] = localise(entrypoint["workingDir"])
    for directory in local.values() if create else ():
        directory.mkdir(parents=True, exist_ok=True)
    return parse_job(doc), local


def cluster_notes(job: ParallelTrainJob) -> list[str]:
    """What a cluster accepts but may not find: the data's and the initial model's paths as a pod resolves them;
    and where a mode auto job's plan comes from there."""
    notes = []
    if job.spec.parallelism.mode == "auto":
        notes.append("parallelism mode auto: the operator plans the layout before any pod exists, for the GPU the "
                     "nodes' nvidia.com/gpu.product labels name (or the platform's planner.gpu; CPU pods: CPUs), "
                     "into status.plan; `paratrain validate --explain --gpu NAME` shows that plan here")
    for field, path in (("spec.data.path", job.spec.data.path), ("spec.model.init", job.spec.model.init)):
        if not path:
            continue
        if not path.startswith("/"):
            notes.append(f"{field}: {path!r} is relative: a pod resolves it in the image's working directory, where "
                         "the CPU trainer image holds examples/ (other data needs a volume)")
        elif volume_of(path, job) is None:
            notes.append(f"{field}: {path} is on no volume of spec.pod.volumes: a pod finds it only if the image "
                         "holds it")
    return notes


def preflight(job: ParallelTrainJob, checksums: bool = True, volumes: Mapping[str, Path] | None = None) -> None:
    """Raise SpecError for what every rank would refuse at start-up on this machine, before any process starts
    (`checksums`: hash a token directory's shards too, as broken_data does; `volumes`: map_volumes' directories)."""
    spec = job.spec
    if spec.entrypoint:  # a program of its own checks what it reads
        return
    missing = missing_data(job, volumes)
    problems = [missing] if missing else broken_data(job, checksums)
    if problem := init_problem(job):
        problems.append(problem)
    if spec.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        problems.append(Problem("spec.logging.tensorboard", "writing event files needs the tensorboard package "
                                "(pip install tensorboard)"))
    if problem := device_problem(job):
        problems.append(problem)
    if problems:
        raise SpecError(problems)


# The precision check on a GPU, run by a short-lived child (`cuda_problem`); its refusal printed, exit 3.
CUDA_CHECK = """import sys
import torch
from paratrain.train.parallel.precision import check_device_supports
try:
    check_device_supports(sys.argv[1], torch.device("cuda"), sys.argv[2] == "1")
except ValueError as exc:
    print(exc)
    sys.exit(3)
"""


def device_problem(job: ParallelTrainJob) -> Problem | None:
    """What this machine's device would refuse of the spec: GPUs it does not have, a precision it cannot run.
    torch is imported only to ask: fp32 needs no question, and the import costs the launcher seconds of CPU (the
    ranks have it from their fork server). A GPU is asked by a child process (`cuda_problem`)."""
    from .train.entrypoint import device_type

    try:
        device = device_type(job)
        if job.spec.precision == "fp32":
            return None
        from .train.parallel.dims import ParallelDims

        deepspeed = ParallelDims.from_spec(job.spec).uses_deepspeed
        if device == "cuda":
            return cuda_problem(job.spec.precision, deepspeed)
        import torch

        from .train.parallel.precision import check_device_supports

        check_device_supports(job.spec.precision, torch.device(device), deepspeed)
    except ValueError as exc:
        path, _, message = str(exc).partition(": ")
        return Problem(path, message)
    return None


def cuda_problem(precision: str, deepspeed: bool) -> Problem | None:
    """The precision check on GPU 0, in a child process that exits with it: made here, its CUDA context (about
    0.5 GiB) would stay on GPU 0 for the whole run, and a GPU in EXCLUSIVE_PROCESS compute mode would refuse the
    rank that needs it."""
    done = subprocess.run([sys.executable, "-c", CUDA_CHECK, precision, "1" if deepspeed else "0"],
                          capture_output=True, text=True, timeout=300)
    if done.returncode == 3:
        path, _, message = done.stdout.strip().partition(": ")
        return Problem(path, message)
    if done.returncode:
        said = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return Problem("spec.resources.gpusPerNode", f"the GPU could not be asked whether it runs "
                       f"spec.precision {precision}: {said}")
    return None


# This machine's GPU 0 by name and memory, asked by a short-lived child (as CUDA_CHECK, for the same reasons).
GPU_NAME = """import torch
properties = torch.cuda.get_device_properties(0)
print(properties.total_memory)
print(properties.name)
"""


def local_target(job: ParallelTrainJob) -> planner.Target:
    """What a mode auto job is planned for when it runs here: this machine's CPU, or its GPU 0."""
    from .train.entrypoint import device_type

    try:
        if device_type(job) == "cpu":
            world, cores = job.spec.world_size, os.cpu_count() or 1
            threads = world * int(_threads_per_rank(world))
            return planner.Target(hardware.CPU, f"this machine's CPU ({cores} cores)", oversubscription=threads / cores)
    except ValueError as exc:
        path, _, message = str(exc).partition(": ")
        raise SpecError([Problem(path, message)]) from None
    done = subprocess.run([sys.executable, "-c", GPU_NAME], capture_output=True, text=True, timeout=300)
    memory, _, name = done.stdout.strip().partition("\n")
    if done.returncode or not memory.isdigit():
        said = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SpecError([Problem("spec.parallelism.mode", f"mode auto could not ask this machine's GPU what it is: "
                                 f"{said}")])
    gpu = hardware.by_device_name(name, int(memory))
    if gpu is None:
        raise SpecError([Problem("spec.parallelism.mode", f"mode auto plans for the GPUs it knows, and this "
                                 f"machine's {name} is not one of them ({', '.join(hardware.BY_NAME)}): give the "
                                 "layout (mode manual)")])
    return planner.Target(gpu, f"this machine's GPU 0 ({name})", int(memory))


def planned_here(job: ParallelTrainJob, vocab: int | None) -> ParallelTrainJob:
    """A mode auto job as it runs here: planned for this machine (local_target) and its data's vocabulary (the
    data must be here), its plan told on stderr; a manual job as it is."""
    if job.spec.parallelism.mode == "manual":
        return job
    if vocab is None:
        raise SpecError([Problem("spec.data.path", "mode auto sizes the model's embedding by the data's vocabulary, "
                                 "and the data is not on this machine")])
    target = local_target(job)
    try:
        spec, result = planner.planned(job.spec, vocab, target)
    except planner.NoPlan as exc:
        raise SpecError([Problem("spec.parallelism", str(exc))]) from None
    chosen = result.chosen
    tokens = spec.training.batch_size * spec.model.block_size
    print(f"paratrain: planned for {target.source}: {chosen.describe()}; predicted peak "
          f"{human(chosen.peak_bytes)} a rank, {tokens / chosen.step_seconds:,.0f} tokens/s ({len(result.feasible)} "
          f"of {result.considered} layouts feasible; `paratrain validate --explain` says why)", file=sys.stderr)
    return job.model_copy(update={"spec": spec})


def root_failure(codes: list[int | None]) -> tuple[int, int] | None:
    """(rank, exit code) of the rank whose failure to report, among the exit codes seen so far (None: running).
    A rank that exited with EXIT_RETRYABLE saw a peer die: the peer is the cause (killed ranks die first, so both
    show in the same poll). As the operator's gang.root_cause does for pods."""
    bad = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
    return min(bad, key=lambda failure: failure[1] == contract.EXIT_RETRYABLE) if bad else None


RUN_LOCK = ".paratrain-run.lock"


def _lock_file(field: str, where: Path) -> Path:
    """Where the lock on `where` lives: in the work directory itself (paratrain's own); for a checkpoint
    directory, which holds only checkpoints, in this user's runtime directory, named by the path's hash."""
    if field == "--workdir":
        where.mkdir(parents=True, exist_ok=True)
        return where / RUN_LOCK
    locks = Path(tempfile.gettempdir()) / f"paratrain-{os.getuid()}"
    locks.mkdir(mode=0o700, exist_ok=True)
    return locks / f"checkpoints-{hashlib.sha256(str(where).encode()).hexdigest()[:24]}.lock"


@contextlib.contextmanager
def one_run_at_a_time(job: ParallelTrainJob, work: Path):
    """Held while a local run lives: its work directory (logs, events, the progress it shows) and its checkpoint
    directory are its own. A second run of the same job, as in a sweep of `--set` overrides, is refused naming the
    live run, rather than given a directory of its own: a rerun in the same place is how a run resumes from its
    checkpoints, and two runs writing one checkpoint directory would each resume from the other's steps. An flock:
    released by the kernel when the run's process ends however it ends, so a crash leaves no stale lock."""
    places = [("--workdir", work, "give this run its own --workdir")]
    if job.spec.checkpoint.path and not job.spec.entrypoint:
        places.append(("spec.checkpoint.path", Path(job.spec.checkpoint.path).resolve(),
                       "give this run its own (--set spec.checkpoint.path=DIR)"))
    with contextlib.ExitStack() as held:
        for field, where, fix in places:
            lock = held.enter_context(open(_lock_file(field, where), "a+"))
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.seek(0)
                holder = lock.read().strip() or "another process"
                raise SpecError([Problem(field, f"{where} is in use by a live run ({holder}): {fix}, or wait for "
                                                "that run to end")]) from None
            lock.truncate(0)
            lock.write(f"pid {os.getpid()}, job {job.metadata.name}, --workdir {work}")
            lock.flush()
        yield


def run_local(job: ParallelTrainJob, metrics_out: str | None = None, workdir: str | None = None,
              progress: bool = True, peak_flops: float | None = None, measure_memory: bool = False,
              mounts: list[str] = ()) -> int:
    work = Path(workdir or Path("runs") / job.metadata.name).resolve()
    job, volumes = map_volumes(job, work, list(mounts))
    for volume in job.spec.pod.volumes:
        print(f"paratrain: volume {volume.name} ({volume.mount_path} in pods) is {volumes[volume.name]}",
              file=sys.stderr)
    if job.spec.parallelism.mode == "auto":
        if problem := missing_data(job, volumes):
            raise SpecError([problem])
        job = planned_here(job, data_vocab(job))
    preflight(job, volumes=volumes)
    with one_run_at_a_time(job, work):
        return _run_gang(job, work, metrics_out, progress, peak_flops, measure_memory)


def _run_gang(job: ParallelTrainJob, work: Path, metrics_out: str | None, progress: bool,
              peak_flops: float | None, measure_memory: bool) -> int:
    spec, own = job.spec, job.spec.entrypoint
    if own:  # what it trains, its devices and its checkpoints are the program's business
        print(f"paratrain: {job.metadata.name}: {describe_layout(spec)}; {' '.join(own.command + own.args)} on "
              f"{spec.nodes} local node(s) of {spec.procs_per_node}; logs in {work / 'logs'}", file=sys.stderr)
    else:
        print(f"paratrain: {job.metadata.name}: {describe_layout(spec)}; {spec.world_size} local processes, "
              f"{spec.training.steps} steps; {describe_checkpoints(spec)}; logs in {work / 'logs'}", file=sys.stderr)
    started = time.monotonic()
    # From the first start on: a Ctrl-C while ranks start still stops them. The store serves until the gang stopped.
    with CtrlC() as ctrl_c, contextlib.ExitStack() as serving:
        if own:
            procs, unit = start_program(job, work, free_port()), "node"
        else:
            store = serving.enter_context(RendezvousStore())
            procs, unit = start_gang(job, work, metrics_out, store.port, peak_flops, measure_memory), "rank"
        view = ProgressView(work / "events.jsonl", live=progress and sys.stderr.isatty())
        failed = watch_gang(procs, view, ctrl_c)
    view.finish()
    if failed:
        rank, code = failed
        who = "interrupted" if rank < 0 else f"{unit} {rank} exited with code {code}"
        log_tail = "" if rank < 0 else _tail(work / "logs" / f"{unit}-{rank}.log")
        print(f"paratrain: {job.metadata.name} failed: {who}; stopped the other {unit}s.\n{log_tail}",
              file=sys.stderr)
        return code if code > 0 else 1
    last = view.last
    steps = last.get("totalSteps", "its") if own else spec.training.steps
    summary = [f"paratrain: {job.metadata.name} finished {steps} steps in {_duration(time.monotonic() - started)}"]
    if last:
        summary.append(f"final train loss {last['loss']:.4f}, {last['tokensPerSecond']:,.0f} tokens/s")
    if view.val_loss is not None or last:
        final_val = _final_val(work / "events.jsonl")
        if final_val is not None:
            summary.append(f"val loss {final_val:.4f}")
    if spec.checkpoint.path:
        summary.append(f"checkpoints in {Path(spec.checkpoint.path).resolve()}")
    if metrics_out:
        summary.append(f"metrics in {metrics_out}")
    print("; ".join(summary), file=sys.stderr)
    return 0


def _final_val(events: Path) -> float | None:
    done = [json.loads(line) for line in events.read_text().splitlines() if '"done"' in line]
    return done[-1].get("valLoss") if done else None


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "".join(f"  | {line}\n" for line in path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
