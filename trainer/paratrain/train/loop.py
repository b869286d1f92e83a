"""The training loop: deterministic batches, warmup + cosine LR, periodic eval and checkpoints, exact resume."""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ..api import Spec
from ..api.spec import TrainingSpec
from ..contract import ENV_HEARTBEAT_DIR, MEASURE_AFTER_STEPS
from ..rounds import beat, heartbeat_file
from .checkpoint import Checkpointer, rank_key, rng_state, set_rng_state
from .host_memory import HostPhases
from .data import TRAIN_STREAM, VAL_STREAM, Corpus, global_batch, rank_rows
from .engine import StepResult
from .nccl_errors import raise_if_aborted
from .parallel.dims import ParallelDims
from .parallel.tensor_parallel import reseeded
from .perf import SteadyRate
from .preemption import Preempted, StopRequest
from .progress import ProgressReporter


def lr_at(step: int, t: TrainingSpec) -> float:
    """Linear warmup to learningRate over warmupSteps, then cosine decay to minLearningRate at `steps`."""
    if step < t.warmup_steps:
        return t.learning_rate * (step + 1) / t.warmup_steps
    decay_steps = t.steps - t.warmup_steps
    progress = (step - t.warmup_steps) / decay_steps if decay_steps > 0 else 1.0
    return t.min_learning_rate + 0.5 * (1 + math.cos(math.pi * progress)) * (t.learning_rate - t.min_learning_rate)


def mean_over_reporters(value: torch.Tensor | float | None, device: torch.device, flags: tuple[bool, ...] = (),
                        norm_square: torch.Tensor | None = None) -> tuple[float, tuple[bool, ...], float | None]:
    """Average a loss (a device tensor, or a number) over the ranks that computed one (pipeline last stages), so
    every rank gets the same value; for each of `flags`, whether any rank raised it (rank 0's "a timed checkpoint
    is due", a rank's SIGTERM), in the same all-reduce; and `norm_square`, the step's squared gradient norm, which
    every rank already holds alike, read with them. The step's one host read: the tensor is filled on the device
    (no host-to-device copy, which waits for the stream too) and read once."""
    if dist.get_world_size() == 1:  # nothing to agree on: a collective per step for nothing
        assert value is not None, "a single process computes every loss"
        if norm_square is None:
            return float(value), tuple(flags), None
        assert isinstance(value, torch.Tensor), "a step's loss is a device tensor"
        mean, square = torch.stack([value.double(), norm_square.double()]).tolist()
        return mean, tuple(flags), square
    t = torch.zeros(2 + len(flags), dtype=torch.float64, device=device)
    if value is not None:
        t[0] = value
        t[1] = 1.0
    for i, flag in enumerate(flags):
        if flag:
            t[2 + i] = 1.0
    dist.all_reduce(t)
    if norm_square is not None:
        t = torch.cat([t, norm_square.double().reshape(1)])
    mean, count, *raised = t.tolist()
    square = raised.pop() if norm_square is not None else None
    return mean / count, tuple(r > 0 for r in raised), square


@dataclass
class TrainedStep:
    loss: float  # the mean over the ranks that computed it
    flags: tuple[bool, ...]  # raised by any rank
    outcome: StepResult
    forward_backward_seconds: float  # to the step's read, which waits for the device
    optimizer_seconds: float  # on a GPU, launching the update: its kernels run on into the next step's read


def train_step(engine, micro_batches: list, lr: float, device: torch.device,
               flags: Callable[[], tuple[bool, ...]] = tuple) -> TrainedStep:
    """One optimizer step as the loop takes it: forward and backward over the micro-batches, the gradient norm's
    collectives, then the step's one host read (mean_over_reporters: the loss, the ranks' `flags`, asked for just
    before it, and the norm), then the update, whose skip and clip the norm decides on the host. DeepSpeed's
    engine reads its own norm inside its step (grad_norm_square: None)."""
    t0 = time.perf_counter()
    local_loss = engine.forward_backward(micro_batches)
    square = engine.grad_norm_square()
    loss, raised, norm_square = mean_over_reporters(local_loss, device, flags(), square)
    if device.type == "cuda":
        raise_if_aborted()  # an aborted collective's kernels ended early: this step's numbers are not to be used
    t1 = time.perf_counter()
    outcome = engine.optimizer_step(lr, norm_square)
    return TrainedStep(loss, raised, outcome, t1 - t0, time.perf_counter() - t1)


@dataclass
class RunResult:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)  # global, unscaled, before clipping
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    skipped_steps: int = 0
    tokens_per_second: float = 0.0  # at steady state (perf.SteadyRate)
    rate_skips_steps: int = 0  # the run's first steps SteadyRate left out
    # This run's steps (not those before a resume), summed (TrainedStep's parts).
    forward_backward_seconds: float = 0.0
    optimizer_seconds: float = 0.0
    start_step: int = 0


class Trainer:
    def __init__(self, spec: Spec, engine, dims: ParallelDims, corpus: Corpus, device: torch.device,
                 reporter: ProgressReporter | None, checkpointer: Checkpointer | None,
                 stop: StopRequest | None = None, host: HostPhases | None = None):
        self.spec, self.engine, self.dims, self.corpus, self.device = spec, engine, dims, corpus, device
        self.reporter, self.checkpointer, self.stop = reporter, checkpointer, stop
        self.host = host or HostPhases()
        self.result = RunResult()
        self.step_in_flight = 0  # the step being trained or evaluated after (from 1), for an error to name
        # Under `paratrain node`: this rank's heartbeat, by which its agent sees it hang (paratrain.rounds).
        beats = os.environ.get(ENV_HEARTBEAT_DIR)
        self.heartbeat = heartbeat_file(beats, dist.get_rank()) if beats and dist.is_initialized() else None

    def _beat(self, step: int) -> None:
        if self.heartbeat:
            beat(self.heartbeat, step)

    @functools.cached_property
    def _rows(self) -> slice:
        """This rank's rows of every global batch (looked up once: the mesh lookup is not free every step)."""
        return rank_rows(self.spec.training.batch_size, self.dims.dp_rank, self.dims.dp)

    def _batch(self, tokens, step: int, stream: int) -> tuple[torch.Tensor, torch.Tensor]:
        t, m = self.spec.training, self.spec.model
        x, y = global_batch(tokens, t.batch_size, m.block_size, t.seed, step, stream, self._rows)
        return x.to(self.device), y.to(self.device)

    def _micro_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's slice of the step's global batch, in gradientAccumulation equal contiguous parts: the same
        global batch, and so the same data, whatever the accumulation."""
        x, y = self._batch(self.corpus.train, step, TRAIN_STREAM)
        k = self.spec.training.gradient_accumulation
        return list(zip(x.chunk(k), y.chunk(k), strict=True))

    def _emit(self, event: str, **fields) -> None:
        if self.reporter:
            self.reporter.emit(event, **fields)

    def _rank_state(self) -> dict:
        """This rank's state that cannot reshard: its random streams."""
        return {"rng": rng_state(), **self.engine.rank_state()}

    def resume(self) -> None:
        """Load the newest sound checkpoint, of this layout or any other (resharded). Random streams come back
        exactly from a checkpoint of this layout; after a layout change they restart from (seed, step)."""
        if not self.checkpointer:
            return
        found = self.checkpointer.latest()
        if found is None:
            return
        try:
            self._resume_from(*found)
        finally:
            self.checkpointer.release()  # the checkpoint's files, held open since they were hashed

    def _resume_from(self, ckpt: Path, manifest: dict) -> None:
        step, own_key = manifest["step"], rank_key(self.checkpointer.rank)
        with self.host.phase("resume"):
            self.engine.restore(lambda part: self.checkpointer.load(ckpt, {"engine": part}))
            self.engine.load_extra_state(manifest["engine"], step, manifest["skippedSteps"])
            own = None
            if self.checkpointer.same_sharding(manifest):
                state = {"rank": {own_key: self._rank_state()}}
                self.checkpointer.load(ckpt, state)
                own = state["rank"][own_key]
        self.engine.load_rank_state(own, step)
        if own:
            set_rng_state(own["rng"])
        else:
            torch.manual_seed(reseeded(self.dims.dropout_seed(self.spec.training.seed), step))
        self.result.losses = list(manifest["losses"])
        self.result.grad_norms = list(manifest["gradNorms"])
        self.result.val_losses = [tuple(v) for v in manifest["valLosses"]]
        self.result.skipped_steps = manifest["skippedSteps"]
        self.result.start_step = step
        self._emit("resume", step=step, checkpoint=str(self.checkpointer.root))

    def evaluate(self) -> float:
        """The mean validation loss over evalSteps batches. Each rank's slice goes through in gradientAccumulation
        parts, as in training: in one forward it would hold that many times the activations and logits training
        ever holds (a 1B model with a 128k vocabulary ran out of memory there, before its first checkpoint)."""
        t = self.spec.training
        total = 0.0
        for i in range(t.eval_steps):
            x, y = self._batch(self.corpus.val, i, VAL_STREAM)
            parts = [self.engine.evaluate(xp, yp) for xp, yp in zip(x.chunk(t.gradient_accumulation),
                                                                   y.chunk(t.gradient_accumulation), strict=True)]
            computed = [loss for loss in parts if loss is not None]  # pipeline stages other than the last: none
            total += mean_over_reporters(sum(computed) / len(computed) if computed else None, self.device)[0]
            self._beat(self.step_in_flight)
        return total / t.eval_steps

    def save(self, step: int) -> None:
        r = self.result
        if self.device.type == "cuda":
            raise_if_aborted()  # the optimizer's collectives ran after the step's check: an aborted step is not saved
        self._beat(step)
        with self.host.phase("save"):  # an async save's: the copy to host memory, before the writer takes it
            state = {"engine": self.engine.state_dict(),
                     "rank": {rank_key(self.checkpointer.rank): self._rank_state()}}
            # Copies: an async save writes its manifest later, after this run's lists have grown.
            meta = {"losses": list(r.losses), "gradNorms": list(r.grad_norms), "valLosses": list(r.val_losses),
                    "skippedSteps": r.skipped_steps, "engine": self.engine.extra_state()}
            committed = self.checkpointer.save(step, state, meta)
        self._committed(committed)
        self._beat(step)

    def _stop(self, step: int) -> None:
        """Save `step` (unless there is no checkpoint path) and leave the loop: the job was asked to stop. How long
        the save took is reported: the grace period it must fit in is checked against an estimate."""
        t0 = time.perf_counter()
        if self.checkpointer:
            self.save(step)
            self._committed(self.checkpointer.wait())
        self._emit("preempted", step=step, saved=bool(self.checkpointer),
                   saveSeconds=round(time.perf_counter() - t0, 3))
        raise Preempted(step, saved=bool(self.checkpointer))

    def _committed(self, step: int | None) -> None:
        if step is not None:
            self._emit("checkpoint", step=step)

    def _step_flags(self, train_time: float) -> tuple[bool, bool]:
        """What a step tells every rank with its loss: a timed checkpoint is due, this rank was asked to stop."""
        return self._timed_save_due(train_time), bool(self.stop and self.stop.requested)

    def _timed_save_due(self, train_time: float) -> bool:
        """Rank 0's view (the flag is all-reduced with the step's loss, so every rank saves at the same step): the
        job saves by minutes (checkpoint.interval unset) and intervalMinutes of training have passed since the
        start or the last save."""
        c = self.spec.checkpoint
        return bool(self.checkpointer and c.interval is None and dist.get_rank() == 0
                    and train_time - self._saved_at >= 60 * c.interval_minutes)

    def _peak_memory(self) -> dict:
        """The largest rank's peak of device memory so far, as {peakMemoryBytes: n} (what the operator sets beside
        the planner's prediction), taken by every rank at the same step; {} on CPU, whose allocator keeps no
        count (a GPU's caching allocator does)."""
        if self.device.type != "cuda":
            return {}
        peak = torch.tensor([torch.cuda.max_memory_allocated(self.device)], device=self.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return {"peakMemoryBytes": int(peak.item())}

    def run(self) -> RunResult:
        try:
            return self._run()
        finally:  # a rank that returned (or left) no longer beats: its agent must not take it for hung
            if self.heartbeat:
                self.heartbeat.unlink(missing_ok=True)

    def _run(self) -> RunResult:
        t, r = self.spec.training, self.result
        self._saved_at = 0.0  # training seconds at the last save
        self.resume()
        if self.checkpointer and r.start_step >= t.steps:
            self._emit("note", message=(
                f"already finished: {self.checkpointer.root} holds the step-{r.start_step} checkpoint of this job's "
                f"{t.steps} steps, so nothing was trained. To train longer raise spec.training.steps; to start "
                "afresh move that directory away or give spec.checkpoint.path another one"))
        rate = SteadyRate(t.batch_size * self.spec.model.block_size)
        self._emit("start", step=r.start_step, startStep=r.start_step, totalSteps=t.steps)
        train_time, t_last = 0.0, time.perf_counter()
        for step in range(r.start_step, t.steps):
            self.step_in_flight = step + 1
            t0 = time.perf_counter()
            trained = train_step(self.engine, self._micro_batches(step), lr_at(step, t), self.device,
                                 flags=functools.partial(self._step_flags, train_time))
            r.forward_backward_seconds += trained.forward_backward_seconds
            r.optimizer_seconds += trained.optimizer_seconds
            loss, (timed_save, stop), outcome = trained.loss, trained.flags, trained.outcome
            dt = time.perf_counter() - t0
            train_time += dt
            rate.add(dt)
            r.losses.append(loss)
            r.grad_norms.append(outcome.grad_norm)
            r.skipped_steps += not outcome.applied
            done = step + 1
            tps = rate.tokens_per_second
            eta = (t.steps - done) * train_time / (done - r.start_step)
            log_now = time.perf_counter() - t_last > 10 or done == t.steps
            t_last = time.perf_counter() if log_now else t_last
            measured = self._peak_memory() if done == min(r.start_step + MEASURE_AFTER_STEPS, t.steps) else {}
            self._emit("step", step=done, totalSteps=t.steps, loss=loss, lr=lr_at(step, t),
                       gradNorm=outcome.grad_norm, applied=outcome.applied, tokensPerSecond=tps, etaSeconds=eta,
                       log=log_now, **measured)
            self._beat(done)
            if stop and done < t.steps:  # every rank saw it in the same all-reduce: all stop at this step
                self._stop(done)
            if done % t.eval_interval == 0 and done < t.steps:
                val = self.evaluate()
                r.val_losses.append((done, val))
                self._emit("eval", step=done, valLoss=val)
            ckpt = self.spec.checkpoint
            due = timed_save if ckpt.interval is None else bool(ckpt.interval) and done % ckpt.interval == 0
            if self.checkpointer and due and done < t.steps:
                self.save(done)
                self._saved_at = train_time
        r.tokens_per_second, r.rate_skips_steps = rate.tokens_per_second, rate.skipped
        if r.start_step < t.steps or not r.val_losses or r.val_losses[-1][0] != t.steps:
            r.val_losses.append((t.steps, self.evaluate()))
        if self.checkpointer and r.start_step < t.steps:
            self.save(t.steps)
        if self.checkpointer:
            self._committed(self.checkpointer.wait())  # an async save's: the run ends when its checkpoint exists
        self._emit("done", step=t.steps, totalSteps=t.steps, valLoss=r.val_losses[-1][1],
                   loss=r.losses[-1] if r.losses else None, tokensPerSecond=r.tokens_per_second, etaSeconds=0)
        return r
