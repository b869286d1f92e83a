"""Test-only faults, loaded into trainer processes via PYTHONPATH when PARATRAIN_TEST_FAULT is set.

    ckpt_crash:<rank>:<step>:file      SIGKILL <rank> inside Checkpointer.save(<step>), after its file is written
                                       into .tmp-step-* and before the manifest exists
    ckpt_crash:0:<step>:manifest       SIGKILL rank 0 after it wrote the manifest, before the directory's rename
    fp16_storm:<rank>:<first>:<count>:<growth>
                                       on <rank>, steps first..first+count-1 run backward with the loss scale
                                       multiplied by 2**100 (fp16 gradients overflow to inf, as in a real overflow
                                       storm); the loss scaler grows every <growth> clean steps; each rank prints
                                       `fault-scale {"step", "applied", "scale"}` after every optimizer step
    lose_node:<rank>:<step>:<KILL|TERM>
                                       after <step> optimizer steps of its process, <rank> signals its node's agent
                                       (`paratrain node`): KILL kills the agent and the rank at once (a
                                       pod whose node is gone), TERM stops it as the kubelet stops a deleted pod
    fail_build:<rank>:<code>           <rank> exits with <code> while building its model, in every round of the first
                                       gang attempt (a bad GPU, a full disk); each exit's time appended to
                                       $PARATRAIN_TEST_FAULT_LOG, where set
    build_oom:<rank>                   <rank> runs out of device memory while building its model (torch's
                                       OutOfMemoryError, as a GPU raises it)
    step_oom:<rank>:<step>             <rank> runs out of device memory in the forward/backward of its <step>th step
    hang_at:<rank>:<step>              <rank> sleeps forever, alive, after <step> optimizer steps of its process in the
                                       first round of in-place restarts (a deadlock, a read that never returns);
                                       the time it began appended to $PARATRAIN_TEST_FAULT_LOG, where set
    exit_at:<rank>:<step>:<code>:<rounds>
                                       <rank> exits with <code> after <step> optimizer steps of its process (a
                                       resumed round counts from its checkpoint's step) in each of the first
                                       <rounds> rounds of in-place restarts (TORCHELASTIC_RESTART_COUNT), in the first
                                       gang attempt only (PARATRAIN_RESTART_ATTEMPT, where set, 0); the time of each
                                       exit appended to $PARATRAIN_TEST_FAULT_LOG, where set
    slow_steps:<seconds>               every rank sleeps <seconds> after each optimizer step, on either engine (a
                                       larger model's step time, so that a live test can act while it trains)
"""

import os

import sys

# Not in `paratrain node`'s own process (torchrun's agent): it runs no rank, and importing the trainer there would
# slow every pod's start, which the restart benchmark measures.
FAULT = os.environ.get("PARATRAIN_TEST_FAULT") if sys.argv[1:2] != ["node"] else None

# Patched in every process that starts with it (the launcher, its fork server, torchrun), and the rank asked at
# each call: a rank forked from `paratrain run`'s fork server gets its RANK after this ran; other processes have none.
if FAULT:
    import json
    import signal

    def _rank() -> int:
        return int(os.environ.get("RANK", "-1"))

    kind, *args = FAULT.split(":")

    def _die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if kind == "ckpt_crash":
        from paratrain.train import checkpoint

        crash_rank, crash_step, phase = int(args[0]), int(args[1]), args[2]
        # Matched by step, not by the temporary name, so a writer that skips the rename is still caught.
        step_name = checkpoint.step_dir_name(crash_step)
        if phase == "file":
            original_commit = checkpoint.Checkpointer._commit

            def _commit(self, step, meta):
                if _rank() == crash_rank and self._tmp(step).name.endswith(step_name):
                    _die()  # the rank's files are complete (and hashed as written); no manifest yet
                return original_commit(self, step, meta)

            checkpoint.Checkpointer._commit = _commit
        elif phase == "manifest":
            original_fsync_dir = checkpoint._fsync_dir

            def _fsync_dir(path):
                if _rank() == crash_rank and path.name.endswith(step_name) and (path / checkpoint.MANIFEST).exists():
                    _die()  # the manifest is written; the rename that makes the checkpoint exist is not done
                return original_fsync_dir(path)

            checkpoint._fsync_dir = _fsync_dir
        else:
            raise SystemExit(f"unknown ckpt_crash phase {phase!r}")

    elif kind == "fp16_storm":
        import functools

        from paratrain.train import build, engine
        from paratrain.train.parallel import precision

        storm_rank, first, count, growth = (int(a) for a in args)
        build.LossScaler = functools.partial(precision.LossScaler, growth_interval=growth)
        original_fb, original_step = engine.TorchEngine.forward_backward, engine.TorchEngine.optimizer_step
        calls = {"fb": 0, "step": 0}

        def forward_backward(self, micro_batches):
            step = calls["fb"]
            calls["fb"] += 1
            if _rank() != storm_rank or not first <= step < first + count:
                return original_fb(self, micro_batches)
            real = self.scaler.scale
            self.scaler.scale = real * 2.0**100
            try:
                return original_fb(self, micro_batches)
            finally:
                self.scaler.scale = real

        def optimizer_step(self, lr, *args):
            outcome = original_step(self, lr, *args)
            print("fault-scale", json.dumps({"step": calls["step"], "applied": outcome.applied,
                                             "scale": self.scaler.scale}), flush=True)
            calls["step"] += 1
            return outcome

        engine.TorchEngine.forward_backward = forward_backward
        engine.TorchEngine.optimizer_step = optimizer_step
    elif kind == "exit_at":
        from paratrain.train import engine

        exit_rank, exit_step, exit_code, rounds = (int(a) for a in args)
        original_step = engine.TorchEngine.optimizer_step
        steps = {"done": 0}

        def optimizer_step(self, lr, *args):
            outcome = original_step(self, lr, *args)
            steps["done"] += 1
            faulty = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) < rounds and \
                os.environ.get("PARATRAIN_RESTART_ATTEMPT", "0") == "0"
            if _rank() == exit_rank and steps["done"] == exit_step and faulty:
                if os.environ.get("PARATRAIN_TEST_FAULT_LOG"):
                    import time

                    with open(os.environ["PARATRAIN_TEST_FAULT_LOG"], "a") as log:
                        log.write(f"{time.time()}\n")
                os._exit(exit_code)
            return outcome

        engine.TorchEngine.optimizer_step = optimizer_step
    elif kind == "slow_steps":
        import time

        from paratrain.train import deepspeed_engine, engine

        pause = float(args[0])

        def slowed(original):
            def optimizer_step(self, lr, *args):
                outcome = original(self, lr, *args)
                time.sleep(pause)
                return outcome
            return optimizer_step

        # both engines: a mode auto job's planner may choose ZeRO on DeepSpeed
        for cls in (engine.TorchEngine, deepspeed_engine.DeepSpeedEngine):
            cls.optimizer_step = slowed(cls.optimizer_step)
    elif kind == "hang_at":
        import time

        from paratrain.train import engine

        hang_rank, hang_step = int(args[0]), int(args[1])
        original_step = engine.TorchEngine.optimizer_step
        steps = {"done": 0}

        def optimizer_step(self, lr, *args):
            outcome = original_step(self, lr, *args)
            steps["done"] += 1
            first_round = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            if _rank() == hang_rank and steps["done"] == hang_step and first_round:
                if os.environ.get("PARATRAIN_TEST_FAULT_LOG"):
                    with open(os.environ["PARATRAIN_TEST_FAULT_LOG"], "a") as log:
                        log.write(f"{time.time()}\n")
                while True:  # alive, holding its process group: its peers block in their next collective
                    time.sleep(60)
            return outcome

        engine.TorchEngine.optimizer_step = optimizer_step
    elif kind == "lose_node":
        from paratrain.train import engine

        lost_rank, lost_step, how = int(args[0]), int(args[1]), getattr(signal, f"SIG{args[2]}")
        original_step = engine.TorchEngine.optimizer_step
        steps = {"done": 0}

        def optimizer_step(self, lr, *args):
            outcome = original_step(self, lr, *args)
            steps["done"] += 1
            if _rank() == lost_rank and steps["done"] == lost_step:
                agent = os.getppid()  # a program's parent; a forked worker's is the agent's fork server
                with open(f"/proc/{agent}/cmdline", "rb") as cmdline:
                    if b"forkserver" in cmdline.read():
                        with open(f"/proc/{agent}/stat") as stat:
                            agent = int(stat.read().rsplit(")", 1)[1].split()[1])
                os.kill(agent, how)
                if how == signal.SIGKILL:
                    _die()
            return outcome

        engine.TorchEngine.optimizer_step = optimizer_step
    elif kind == "fail_build":
        import time

        from paratrain.train import build

        fail_rank, fail_code, original_build = int(args[0]), int(args[1]), build.build_engine

        def build_engine(*args, **kwargs):
            if _rank() == fail_rank and os.environ.get("PARATRAIN_RESTART_ATTEMPT", "0") == "0":
                if os.environ.get("PARATRAIN_TEST_FAULT_LOG"):
                    with open(os.environ["PARATRAIN_TEST_FAULT_LOG"], "a") as log:
                        log.write(f"{time.time()}\n")
                os._exit(fail_code)
            return original_build(*args, **kwargs)

        build.build_engine = build_engine
    elif kind == "build_oom":
        import torch

        from paratrain.train import build

        oom_rank, original_build = int(args[0]), build.build_engine

        def build_engine(*args, **kwargs):
            if _rank() == oom_rank:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                                             "capacity of 79.19 GiB of which 1.06 GiB is free.")
            return original_build(*args, **kwargs)

        build.build_engine = build_engine
    elif kind == "step_oom":
        import torch

        from paratrain.train import engine

        oom_rank, oom_step = int(args[0]), int(args[1])
        original_forward_backward = engine.TorchEngine.forward_backward
        steps = {"begun": 0}

        def forward_backward(self, micro_batches):
            steps["begun"] += 1
            if _rank() == oom_rank and steps["begun"] == oom_step:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.50 GiB. GPU 0 has a total "
                                             "capacity of 79.19 GiB of which 2.12 GiB is free.")
            return original_forward_backward(self, micro_batches)

        engine.TorchEngine.forward_backward = forward_backward
    else:
        raise SystemExit(f"unknown PARATRAIN_TEST_FAULT {FAULT!r}")
