"""Test-only sabotage, loaded into trainer processes via PYTHONPATH when PARATRAIN_TEST_MUTANT is set.

Proves the parity tests can fail: each mutant breaks one gradient reduction the way real bugs do.
"""

import os

MUTANT = os.environ.get("PARATRAIN_TEST_MUTANT")

if MUTANT:
    import torch.distributed as dist

    from paratrain.train import engine, parallelize, pipeline

    if MUTANT == "ddp_skips_allreduce":
        parallelize.apply_ddp = lambda model, dp_mesh: model

    elif MUTANT == "ddp_sums_instead_of_averaging":
        original = parallelize.apply_ddp

        def _summing_ddp(model, dp_mesh):
            ddp = original(model, dp_mesh)

            def _sum_hook(state, bucket):
                fut = dist.all_reduce(bucket.buffer(), group=dp_mesh.get_group(), async_op=True).get_future()
                return fut.then(lambda f: f.value()[0])

            ddp.register_comm_hook(None, _sum_hook)
            return ddp

        parallelize.apply_ddp = _summing_ddp

    elif MUTANT == "composed_skips_allreduce":
        engine.allreduce_gradients = lambda params, dp_mesh: None

    elif MUTANT == "pipeline_sums_microbatches":
        original_build = pipeline.build_schedule

        def _unscaled(*args, **kwargs):
            schedule = original_build(*args, **kwargs)
            schedule.scale_grads = False
            return schedule

        parallelize.build_schedule = _unscaled
    elif MUTANT.startswith("crash:"):
        # crash:<rank>:<step> — SIGKILL that rank as it starts that (0-based) step: a node dying mid-training.
        import signal

        from paratrain.train import loop

        crash_rank, crash_step = (int(v) for v in MUTANT.split(":")[1:])
        original_lr_at = loop.lr_at

        def _lr_at(step, t):
            if step == crash_step and int(os.environ["RANK"]) == crash_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            return original_lr_at(step, t)

        loop.lr_at = _lr_at
    else:
        raise SystemExit(f"unknown PARATRAIN_TEST_MUTANT {MUTANT!r}")
