"""`paratrain train`: what every process of a job runs, on a laptop or in a pod.

Reads the spec and torchrun's worker env (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), initialises the
process group (gloo on CPU, NCCL on GPU) with the spec's collective timeout, builds the mesh and the engine,
resumes from the latest complete checkpoint, trains, and exits with a code the operator can classify.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import sys

from .. import contract
from ..api import ParallelTrainJob, SpecError, describe_checkpoints, describe_layout, layout_label, load_job
from ..api.memory import memory_problem
from .progress import write_termination_message

log = logging.getLogger("paratrain.train")


class EnvError(ValueError):
    pass


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise EnvError(f"{name} is not set: run through `paratrain run` or torchrun, which set the worker env")
    return int(value)


def device_type(job: ParallelTrainJob) -> str:
    """"cuda" when the spec asks for GPUs (unless PARATRAIN_DEVICE=cpu forces the CPU), else "cpu"."""
    gpus = job.spec.resources.gpus_per_node
    if gpus == 0 or os.environ.get(contract.ENV_DEVICE) == "cpu":
        return "cpu"
    import torch  # here, not above: the launcher asks too, and importing torch costs it seconds of CPU

    if not torch.cuda.is_available():
        # Permanent, not a silent fallback: a job sized for GPUs would train on CPU orders of magnitude slower.
        raise ValueError(f"spec.resources.gpusPerNode: the job asks for {gpus} GPU(s) per node, but no CUDA "
                         "device is visible to this process; set gpusPerNode: 0 to train on CPU (or "
                         f"{contract.ENV_DEVICE}=cpu to force the CPU for this run)")
    return "cuda"


def allocator_defaults(env: dict[str, str]) -> dict[str, str]:
    """The CUDA caching allocator's settings the trainer defaults to, where the pod or shell sets none:
    expandable segments, which grow one mapping instead of caching blocks of fixed sizes, so memory freed by
    one shape serves the next (long runs, pipeline microbatches and varying loss pieces fragment less; PyTorch's
    own advice for out-of-memory errors with much reserved but unallocated memory)."""
    if env.get("PYTORCH_ALLOC_CONF") or env.get("PYTORCH_CUDA_ALLOC_CONF"):
        return {}
    return {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}


def pick_device(job: ParallelTrainJob, local_rank: int):
    """(device, backend): this rank's GPU with NCCL when the spec asks for GPUs, else the CPU with gloo."""
    import torch

    if device_type(job) == "cuda":
        from .nccl_errors import comms_defaults

        os.environ.update(allocator_defaults(os.environ))  # read when the allocator starts: before any allocation
        os.environ.update(comms_defaults(os.environ))  # read when the NCCL process groups are made
        torch.cuda.set_device(local_rank)
        torch.set_float32_matmul_precision("high" if job.spec.tf32 else "highest")  # "high": TF32 tensor cores
        torch.backends.cudnn.allow_tf32 = job.spec.tf32
        return torch.device("cuda", local_rank), "nccl"
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported
    return torch.device("cpu"), "gloo"


class OutOfMemory(Exception):
    """The device ran out of memory, building the model or in a step: the layout does not fit at this batch,
    whatever restarts (EXIT_OUT_OF_MEMORY)."""


def out_of_memory(exc: BaseException, where: str, device, spec) -> OutOfMemory:
    """torch's OutOfMemoryError as the pod's error: where (the rank and step, or the build), the bytes torch asked
    for (its first line), and what shrinks them."""
    first_line = (str(exc).splitlines() or [type(exc).__name__])[0].rstrip(".")
    return OutOfMemory(
        f"out of memory {where} on {device} ({describe_layout(spec)}): {first_line}. This layout needs fewer bytes "
        "per device: more tensor or pipeline ranks, a higher parallelism.zeroStage, bf16, activation checkpointing "
        "or smaller micro-steps (training.gradientAccumulation); `paratrain validate --memory` estimates each layout")


def _refuse(exc: Exception, code: int = contract.EXIT_INVALID_SPEC) -> int:
    """A job this rank cannot train (the field and the fix in the message): logged, and the pod's termination
    message, from which the operator puts it in the job's status and a Warning Event."""
    log.error("%s", exc)
    write_termination_message({"error": str(exc)})
    return code


def exit_now(code: int) -> None:
    """End a trainer process with its exit code, skipping interpreter teardown: there, C++ threads of torch's
    process groups can still be joinable and abort the process (SIGABRT: "terminate called without an active
    exception"), so a rank that refused a checkpoint as an invalid spec would be reported as crashed. Everything
    the run writes is closed before it returns. The tests' and benchmarks' spawned ranks end through it too."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def train_main(spec_path: str) -> int:
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format=f"%(asctime)s [rank {rank}] %(name)s %(levelname)s: %(message)s")
    try:
        job = load_job(spec_path)
        world, local_rank = _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK")
        if world != job.spec.world_size:
            raise EnvError(f"WORLD_SIZE={world} but the spec's nodes x procsPerNode = {job.spec.world_size}")
    except (SpecError, EnvError) as exc:
        return _refuse(exc)
    from .preflight import FabricError

    try:
        return _train(job, rank, world, local_rank)
    except ValueError as exc:  # a spec the device or data cannot honour (named in the message)
        return _refuse(exc)
    except OutOfMemory as exc:
        return _refuse(exc, contract.EXIT_OUT_OF_MEMORY)
    except FabricError as exc:
        log.error("preflight: %s; the gang should restart", exc)
        return contract.EXIT_RETRYABLE
    except Exception as exc:  # noqa: BLE001 (classify every failure for the operator)
        if is_peer_failure(exc):
            what = (f"a collective timed out (spec.runPolicy.collectiveTimeoutSeconds="
                    f"{job.spec.run_policy.collective_timeout_seconds}): a rank is hung or too slow"
                    if _is_timeout(exc) else "a peer failed")
            said = "; ".join([str(exc), *getattr(exc, "__notes__", [])])
            log.error("%s (%s: %s); the gang should restart", what, type(exc).__name__, said)
            return contract.EXIT_RETRYABLE
        raise


def _last_round_failure(world: int, round_: int) -> tuple[int, dict] | None:
    """In round `round_` of in-place restarts (preflight.join's, the same on every rank): (the round, the rank
    whose exit ended the last one), from what each node's agent told its workers (ENV_LAST_FAILURE), gathered from
    every rank; the root cause is a rank that did not merely see its peer die (exit 75). A replaced pod's fresh
    agent tells nothing. None in the first round."""
    import torch.distributed as dist

    if not round_:
        return None
    said: list = [None] * world
    dist.all_gather_object(said, os.environ.get(contract.ENV_LAST_FAILURE))
    failures = sorted((json.loads(s) for s in said if s), key=lambda f: (f.get("exitCode") == contract.EXIT_RETRYABLE,
                                                                        f.get("rank", 0)))
    return round_, failures[0] if failures else {}


def _is_timeout(exc: BaseException) -> bool:
    """Only words the log line: `is_peer_failure` has already decided the exit code."""
    text = str(exc).lower()
    return isinstance(exc, TimeoutError) or "timed out" in text or "timeout" in text


# gloo (torch 2.13) raises a dead peer ("Connection closed by peer", "Connection reset by peer") and a collective
# timeout ("Timed out waiting 10000ms for recv operation") as plain RuntimeErrors, from collectives and from DDP's
# hooks inside backward alike, whose message starts with the gloo transport source file that threw them:
# "[.../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer ...". gloo's assertion
# failures read "[enforce fail at ...]" and do not match; neither does a message that merely mentions gloo.
_GLOO_TRANSPORT_ERROR = re.compile(r"\[(?:[^\]\s]*/)?gloo/transport/[^\]\s]+:\d+\] ")


def is_peer_failure(exc: BaseException) -> bool:
    """Whether `exc` says the gang broke (a peer died or hung, the rendezvous store is gone), so a restart may
    succeed, rather than that this rank's own code failed. Decided by the exception's type and, for gloo, by the
    source it was raised from; never by words in a message, which a deterministic bug can contain too.

    c10d raises DistNetworkError (a store or peer socket failed), DistStoreError (a store wait timed out: a rank
    never arrived) and DistBackendError (NCCL errors and timeouts). A collective whose ranks disagree (sizes,
    order) also surfaces as a dead peer (gloo aborts the rank that notices) or as a timeout: no rank can tell that
    from a transient fault, and the operator's backoffLimit bounds such restarts.
    """
    import torch.distributed as dist

    if isinstance(exc, (dist.DistNetworkError, dist.DistStoreError, dist.DistBackendError, ConnectionError,
                        TimeoutError)):
        return True
    return isinstance(exc, RuntimeError) and _GLOO_TRANSPORT_ERROR.match(str(exc)) is not None


def _train(job: ParallelTrainJob, rank: int, world: int, local_rank: int) -> int:
    """The gang's set-up around the run: the device, the rendezvous, the process group and its preflight; a
    collective's timeout gets the roll call's answer (which ranks are hung) in its notes."""
    import torch.distributed as dist

    from .parallel.compile import compile_problem
    from .parallel.dims import ParallelDims
    from .parallel.precision import check_device_supports
    from .nccl_errors import timed_out
    from .preflight import PREFLIGHT_SECONDS, ROLL_CALL_SECONDS, answer_roll_call, describe_silent, join, \
        prove_fabric, roll_call, wait_everywhere

    spec = job.spec
    device, backend = pick_device(job, local_rank)
    dims = ParallelDims.from_spec(spec, world, device.type)
    check_device_supports(spec.precision, device, dims.uses_deepspeed)
    if spec.training.compile and (problem := compile_problem(device)):
        raise ValueError(problem)
    timeout = datetime.timedelta(seconds=spec.run_policy.collective_timeout_seconds)
    preflight_seconds = min(PREFLIGHT_SECONDS, spec.run_policy.collective_timeout_seconds)
    # After a failure, the gang's survivors wait for a replaced pod as long as the operator waits for it to start.
    store, hosts, round_ = join(rank, world, preflight_seconds, spec.scheduling.start_timeout_seconds)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout,
                            device_id=device if backend == "nccl" else None)
    try:
        prove_fabric(device, hosts, preflight_seconds)
        wait_everywhere(timeout)
        return _run(job, rank, world, device, dims, round_)
    except Exception as exc:
        if is_peer_failure(exc):
            if _is_timeout(exc) or (backend == "nccl" and timed_out()):
                wait = min(ROLL_CALL_SECONDS, spec.run_policy.collective_timeout_seconds)
                exc.add_note(describe_silent(roll_call(store, rank, world, wait), wait))
            else:  # not hung: said at once to the ranks whose collectives timed out and call the roll
                answer_roll_call(store, rank)
        raise
    finally:
        dist.destroy_process_group()


def _run(job: ParallelTrainJob, rank: int, world: int, device, dims, round_: int) -> int:
    """The run, once the gang is proven (in-place restart round `round_`): data, engine, training, the final
    report."""
    import torch
    import torch.distributed as dist

    from .checkpoint import Checkpointer
    from .data import load_corpus
    from .host_memory import HostPhases
    from .loop import Trainer
    from .models.gpt import attention_kernel
    from .models.hf_config import init_problem
    from .models.registry import model_config
    from .parallel.precision import DTYPES
    from .build import build_engine
    from .perf import device_peak_flops, mfu, model_flops_per_token, peak_memory_bytes, peak_reserved_bytes, \
        tensor_peak
    from .preemption import Preempted, StopRequest
    from .progress import ProgressReporter, TensorBoardWriter, write_json

    spec = job.spec
    corpus = load_corpus(spec.data.source, spec.data.path, spec.data.val_fraction, spec.model.vocab_size,
                         spec.training.seed, spec.model.block_size)
    if spec.model.init and (problem := init_problem(spec.model, corpus.vocab_size)):
        raise ValueError(f"spec.model.init: {problem}")
    if spec.data.vocab_size and spec.data.vocab_size != corpus.vocab_size:
        raise ValueError(f"spec.data.vocabSize: {spec.data.vocab_size}, but the data's vocabulary is "
                         f"{corpus.vocab_size} ({spec.data.source} {spec.data.path or ''})".rstrip())
    if problem := memory_problem(spec, corpus.vocab_size):  # the operator may not know the data's vocabulary
        raise ValueError(f"spec.resources.gpuMemory: {problem}")
    torch.manual_seed(dims.dropout_seed(spec.training.seed))
    restarted = _last_round_failure(world, round_)
    reporter = None
    if rank == 0:
        port = os.environ.get(contract.ENV_PROGRESS_PORT)
        tensorboard = TensorBoardWriter(str(_resolve(spec.logging.tensorboard))) if spec.logging.tensorboard \
            else None
        reporter = ProgressReporter(spec.training.steps, os.environ.get(contract.ENV_EVENTS_FILE),
                                    os.environ.get(contract.ENV_PROGRESS_HOST), int(port) if port else None,
                                    tensorboard)
        kernel = attention_kernel(device.type, DTYPES[spec.precision], spec.model.kv_heads != spec.model.heads)
        log.info("job %s: %s on %d ranks, device %s, backend %s, attention %s; %s", job.metadata.name,
                 describe_layout(spec), world, device, dist.get_backend(), kernel, describe_checkpoints(spec))
        if restarted:
            reporter.restarted(*restarted)
    checkpointer = None
    if spec.checkpoint.path:
        checkpointer = Checkpointer(_resolve(spec.checkpoint.path), rank, world, layout_label(spec),
                                    spec.checkpoint.keep, spec.checkpoint.async_save)
    host = HostPhases()
    with tensor_peak(device, os.environ.get(contract.ENV_MEASURE_MEMORY) == "1") as peak_tensor_bytes:
        try:
            with host.phase("build"):
                engine = build_engine(spec, dims, device, corpus.vocab_size)
        except torch.OutOfMemoryError as exc:
            raise out_of_memory(exc, "while building the model, before any step,", device, spec) from None
        # From here a SIGTERM stops at the next step boundary, with a checkpoint (before: at once, as ever).
        stop = StopRequest()
        trainer = Trainer(spec, engine, dims, corpus, device, reporter, checkpointer, stop, host)
        try:
            result = trainer.run()
        except torch.OutOfMemoryError as exc:
            raise out_of_memory(exc, f"on rank {rank} in step {trainer.step_in_flight}", device, spec) from None
        except Preempted as stopped:
            if reporter:
                reporter.close()  # the last progress becomes the pod's termination message
            where = "its checkpoint is written" if stopped.saved else "no checkpoint (spec.checkpoint.path unset)"
            log.warning("preempted at step %d: %s; exiting %d", stopped.step, where, contract.EXIT_PREEMPTED)
            return contract.EXIT_PREEMPTED
    tensor_peaks: list = [None] * world
    dist.all_gather_object(tensor_peaks, peak_tensor_bytes())
    state_bytes: list = [None] * world
    dist.all_gather_object(state_bytes, {"rank": rank, **engine.state_bytes()})
    peak_memory, peak_memory_kind = peak_memory_bytes(device)
    phases = host.as_dict()
    if peak_memory_kind == "max_rss":  # a phase's peak, read by its own counter at its end, is the run's too
        peak_memory = max([peak_memory, *(phase["peakRssBytes"] for phase in phases.values())])
    peaks: list = [None] * world
    dist.all_gather_object(peaks, (peak_memory, peak_reserved_bytes(device), phases))  # one collective
    peak_memories, peaks_reserved, host_phases = [p[0] for p in peaks], [p[1] for p in peaks], [p[2] for p in peaks]
    metrics_out = os.environ.get(contract.ENV_METRICS_OUT)
    if rank == 0:
        flops_per_token = model_flops_per_token(model_config(spec, corpus.vocab_size))
        given_peak = os.environ.get(contract.ENV_PEAK_FLOPS)
        peak_flops = device_peak_flops(device, float(given_peak) if given_peak else None)
        achieved = flops_per_token * result.tokens_per_second  # the whole job's model FLOP/s
        utilisation = mfu(flops_per_token, result.tokens_per_second, peak_flops, world)
        reporter.emit("performance", modelFlopsPerToken=flops_per_token, achievedFlopsPerSecond=achieved,
                      mfu=utilisation, peakMemoryBytes=max(peak_memories), peakMemoryKind=peak_memory_kind,
                      peakReservedBytes=None if None in peaks_reserved else max(peaks_reserved),
                      hostPeakRssBytes={phase: max(h[phase]["peakRssBytes"] for h in host_phases if phase in h)
                                        for phase in host_phases[0]})
        if metrics_out:
            write_json(metrics_out, {
                "losses": result.losses, "grad_norms": result.grad_norms, "val_loss": result.val_losses[-1][1],
                "val_losses": result.val_losses, "tokens_per_second": result.tokens_per_second,
                "tokens_per_second_skips_steps": result.rate_skips_steps,
                "skipped_steps": result.skipped_steps, "resumed_from_step": result.start_step,
                "model_state_bytes": state_bytes, "layout": layout_label(spec), "world_size": world,
                "model_flops_per_token": flops_per_token, "achieved_flops_per_second": achieved,
                "peak_flops_per_device": peak_flops, "mfu": utilisation,
                "peak_memory_bytes": peak_memories, "peak_memory_kind": peak_memory_kind,
                "peak_reserved_bytes": peaks_reserved,
                "peak_tensor_bytes": tensor_peaks,
                "host_phases": host_phases,
                "step_time_seconds": {"forward_backward": result.forward_backward_seconds,
                                      "optimizer": result.optimizer_seconds},
            })
        reporter.close()
    dist.barrier()
    return contract.EXIT_OK


def _resolve(path: str):
    from pathlib import Path

    return Path(path).expanduser().resolve()
