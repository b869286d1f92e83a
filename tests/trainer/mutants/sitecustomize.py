"""Test-only sabotage, loaded into trainer processes via PYTHONPATH when PARATRAIN_TEST_MUTANT is set.

Proves the parity tests can fail: each mutant breaks one gradient reduction the way real bugs do. Two observers
change nothing: `dump_model:<dir>` saves what each rank holds for tests to compare, `record_deepspeed_handoff:<dir>`
what each rank holds of the model DeepSpeed is given.

PARATRAIN_TEST_CPU_FP16 (`native` or `none`), independent of the mutant: the CPU's answer to "native fp16?"
(AVX512-FP16 or AMX-FP16, as oneDNN reports it), forced in both probes that read it: paratrain's
(`precision.cpu_has_native_fp16`, which refuses fp16 DeepSpeed jobs without it) and DeepSpeed's CPU accelerator's
(which refuses fp16 without it and, in 0.19.8, chose ZeRO-3's dtype by it). A process then decides as it would on
such a CPU. torch's kernels are untouched: where fp16 is not native, torch emulates it with the same rounding
(inputs and output rounded to fp16, fp32 accumulation: measured on an AMD EPYC), so a forced `native` runs the
native branch's code with its numerics, only slower.
"""

import os

CPU_FP16 = os.environ.get("PARATRAIN_TEST_CPU_FP16")
MUTANT = os.environ.get("PARATRAIN_TEST_MUTANT")

if CPU_FP16:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as the trainer sets it, before DeepSpeed is first imported
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    from paratrain.train.parallel import precision

    native = {"native": True, "none": False}[CPU_FP16]
    precision.cpu_has_native_fp16 = lambda: native
    CPU_Accelerator.is_fp16_supported = lambda self: native

if MUTANT:
    import torch.distributed as dist

    from paratrain.train.parallel import data_parallel, parallelize
    from paratrain.train import engine

    if MUTANT == "ddp_skips_allreduce":
        parallelize.apply_ddp = lambda model, dp_mesh, reduce_dtype=None: model

    elif MUTANT == "ddp_sums_instead_of_averaging":
        original = parallelize.apply_ddp

        def _summing_ddp(model, dp_mesh, reduce_dtype=None):
            ddp = original(model, dp_mesh)

            def _sum_hook(state, bucket):
                fut = dist.all_reduce(bucket.buffer(), group=dp_mesh.get_group(), async_op=True).get_future()
                return fut.then(lambda f: f.value()[0])

            ddp.register_comm_hook(None, _sum_hook)
            return ddp

        parallelize.apply_ddp = _summing_ddp

    elif MUTANT == "composed_skips_allreduce":
        data_parallel.OverlappedGradReducer._launch = lambda self, i: None

    elif MUTANT == "composed_reduces_before_the_last_microbatch":
        # A bucket counted as final after one pipeline microbatch's gradients: the others are never reduced.
        expect = data_parallel.OverlappedGradReducer.expect
        data_parallel.OverlappedGradReducer.expect = lambda self, passes: expect(self, 1)

    elif MUTANT == "pipeline_sums_microbatches":
        engine.loss_weight = lambda accumulation, microbatches: 1.0 / accumulation

    elif MUTANT == "accumulation_sums_micro_steps":
        # Each micro-step's gradient added at full weight: k times the step's gradient.
        engine.loss_weight = lambda accumulation, microbatches: 1.0 / microbatches
    elif MUTANT.startswith("absent:"):
        # absent:<rank> — that rank never checks in at the rendezvous: a pod that cannot reach rank 0's address.
        import time

        from paratrain.train import preflight

        # Asked at the call, not here: a rank forked from the launcher's fork server gets its RANK after this ran.
        original_join = preflight.join
        preflight.join = lambda rank, world, *timeouts: (time.sleep(3600) if str(rank) == MUTANT.split(":")[1]
                                                         else original_join(rank, world, *timeouts))
    elif MUTANT == "fabric_drops_the_all_reduce":
        # An all-reduce that completes and sums nothing (each rank keeps its own value): the data are wrong.
        dist.all_reduce = lambda tensor, *args, **kwargs: None
    elif MUTANT.startswith(("crash:", "sigterm:")):
        # crash:<rank>:<step> — SIGKILL that rank as it starts that (0-based) step: a node dying mid-training.
        # sigterm:<rank>:<step> — SIGTERM it instead: its pod is being stopped (a drain, a preemption).
        import signal

        from paratrain.train import loop

        kind, signal_rank, signal_step = MUTANT.split(":")
        sent = signal.SIGKILL if kind == "crash" else signal.SIGTERM
        original_lr_at = loop.lr_at

        def _lr_at(step, t):
            if step == int(signal_step) and os.environ["RANK"] == signal_rank:
                os.kill(os.getpid(), sent)
            return original_lr_at(step, t)

        loop.lr_at = _lr_at
    elif MUTANT in ("deepspeed_skips_reduction", "deepspeed_sums_instead_of_averaging"):
        # DeepSpeed's gradient collectives (ZeRO-1/2 bucket reduce, ZeRO-3 reduce-scatter) either do nothing — as
        # 0.19 is reported to do on CPU tensors with contiguous_gradients and reduce_scatter off — or leave the sum
        # of the ranks' gradients. Scalars (gradient norms, overflow flags) still reduce correctly.
        from paratrain.train import deepspeed_engine

        original_build = deepspeed_engine.build_deepspeed_engine
        skip = MUTANT == "deepspeed_skips_reduction"

        def _is_gradient(t):
            return t.is_floating_point() and t.numel() > 1

        def _sabotaged_build(*args, **kwargs):
            built = original_build(*args, **kwargs)
            import deepspeed.comm as ds_dist

            all_reduce, reduce, reduce_scatter_fn = ds_dist.all_reduce, ds_dist.reduce, ds_dist.reduce_scatter_fn

            def _all_reduce(tensor, *a, **kw):
                if not _is_gradient(tensor):
                    return all_reduce(tensor, *a, **kw)
                if not skip:
                    all_reduce(tensor, *a, **kw)
                    tensor.mul_(dist.get_world_size())

            def _reduce(tensor, *a, **kw):
                if not _is_gradient(tensor):
                    return reduce(tensor, *a, **kw)
                if not skip:
                    reduce(tensor, *a, **kw)
                    tensor.mul_(dist.get_world_size())

            def _reduce_scatter_fn(output, tensor, *a, **kw):
                if skip:
                    output.copy_(tensor.view(dist.get_world_size(), -1)[dist.get_rank()])
                else:
                    reduce_scatter_fn(output, tensor, *a, **kw)
                    output.mul_(dist.get_world_size())

            ds_dist.all_reduce, ds_dist.reduce, ds_dist.reduce_scatter_fn = _all_reduce, _reduce, _reduce_scatter_fn
            return built

        deepspeed_engine.build_deepspeed_engine = _sabotaged_build
    elif MUTANT.startswith("asleep:"):
        # asleep:<rank>:<step> — from that (0-based) step on, that rank falls asleep before its next tensor-parallel
        # all-reduce (DTensor's, from a row-parallel layer) and never joins it: a hung rank its TP peers wait on.
        import time

        import torch.distributed._functional_collectives as funcol

        from paratrain.train import loop

        _, sleepy_rank, sleepy_step = MUTANT.split(":")
        original_lr_at, original_all_reduce = loop.lr_at, funcol.all_reduce
        armed = []

        def _lr_at(step, t):
            if step == int(sleepy_step) and os.environ["RANK"] == sleepy_rank:
                armed.append(step)
            return original_lr_at(step, t)

        def _all_reduce(*args, **kwargs):
            if armed:
                print(f"mutant: rank {sleepy_rank} falls asleep at {time.time():.3f}", flush=True)
                time.sleep(3600)
            return original_all_reduce(*args, **kwargs)

        loop.lr_at, funcol.all_reduce = _lr_at, _all_reduce
    elif MUTANT.startswith("overflow:"):
        # overflow:<rank>:<step> — that rank's gradients become inf in that (0-based) training step, as an fp16
        # overflow does; the loss itself stays finite. Every rank must skip the step.
        import torch

        from paratrain.train import deepspeed_engine

        overflow_rank, overflow_step = (int(v) for v in MUTANT.split(":")[1:])
        training_calls = [0]

        class _InfGradient(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t):
                return t.clone()

            @staticmethod
            def backward(ctx, grad):
                return grad * float("inf")

        def _overflowing(cross_entropy):
            def _loss(logits, targets):
                if logits.requires_grad:
                    if training_calls[0] == overflow_step and int(os.environ["RANK"]) == overflow_rank:
                        logits = _InfGradient.apply(logits)
                    training_calls[0] += 1
                return cross_entropy(logits, targets)

            return _loss

        engine.cross_entropy = _overflowing(engine.cross_entropy)
        deepspeed_engine.cross_entropy = _overflowing(deepspeed_engine.cross_entropy)
    elif MUTANT.startswith("dump_model:"):
        # dump_model:<dir> — when training ends, each rank saves its module's tensors as it holds them (replicas
        # and shards alike) to <dir>/rank-<N>.pt: checkpoints keep one copy of what replicas hold.
        import torch

        from paratrain.train import loop
        from paratrain.train.parallel.tensors import local

        dump_dir = MUTANT.split(":", 1)[1]
        original_run = loop.Trainer.run

        def _run(self):
            result = original_run(self)
            state = {name: local(t).detach().clone() for name, t in self.engine.module.state_dict().items()}
            if self.engine.heads_rng:
                state["headsRng"] = self.engine.heads_rng.state
            torch.save(state, f"{dump_dir}/rank-{os.environ['RANK']}.pt")
            return result

        loop.Trainer.run = _run
    elif MUTANT.startswith("record_deepspeed_handoff:"):
        # record_deepspeed_handoff:<dir> — what each rank's model holds of every parameter when it is handed to
        # DeepSpeed (just built and initialised; its optimizer is built next), to <dir>/rank-<N>.json.
        import json
        import math

        from paratrain.train import deepspeed_engine
        from paratrain.train.parallel.tensors import full_shape_of

        record_dir = MUTANT.split(":", 1)[1]
        original_build_optimizer = deepspeed_engine.build_optimizer

        def _recording_build_optimizer(model, *args, **kwargs):
            held = {name: {"elements": math.prod(full_shape_of(p)), "held": p.data.numel(),
                           "partition": p.ds_tensor.numel() if hasattr(p, "ds_tensor") else None}
                    for name, p in model.named_parameters()}
            os.makedirs(record_dir, exist_ok=True)
            with open(f"{record_dir}/rank-{os.environ['RANK']}.json", "w") as f:
                json.dump(held, f)
            return original_build_optimizer(model, *args, **kwargs)

        deepspeed_engine.build_optimizer = _recording_build_optimizer
    else:
        raise SystemExit(f"unknown PARATRAIN_TEST_MUTANT {MUTANT!r}")
