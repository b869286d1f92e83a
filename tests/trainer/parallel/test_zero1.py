"""Composed ZeRO-1 (zero1.ZeroOneOptimizer over the reducer's reduce-scatter mode) on a real 2-rank gloo dp group:
per optimizer step one reduce-scatter and one all-gather per gradient bucket and no broadcasts; the same training as
a plain AdamW on the whole batch; half the optimizer state and gradients per rank; name-keyed whole-parameter
checkpoint state that reloads into other buckets. The parallel runs in test_parity cover TP/PP and DCP."""

import contextlib
import itertools
import json
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from paratrain.train.parallel.data_parallel import Bucket

from ..harness import spawn_ranks

STEPS = 3
BUCKET_BYTES = 4096  # several buckets for the tiny model, parameters straddling shard boundaries
COLLECTIVES = ("broadcast", "all_reduce", "reduce_scatter_single", "all_gather_single")


def state_keys(state: dict[str, dict]) -> dict[str, list[str]]:
    return {name: sorted(values) for name, values in state.items()}


@contextlib.contextmanager
def counted_collectives() -> Iterator[dict[str, int]]:
    """Calls of each of COLLECTIVES made inside the block."""
    calls = dict.fromkeys(COLLECTIVES, 0)
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(name: str):
        def call(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)
        return call

    for name in COLLECTIVES:
        setattr(dist, name, counting(name))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def whole(share: dict) -> dict:
    """Every dp rank's share of a checkpoint's optimizer state, merged (collective)."""
    shares: list = [None] * dist.get_world_size()
    dist.all_gather_object(shares, share)
    return {name: values for each in shares for name, values in each.items()}


def train(rank: int, store_file: str, out: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from paratrain.train.parallel.data_parallel import OverlappedGradReducer
    from paratrain.train.parallel.dims import ParallelDims
    from paratrain.train.engine import TorchEngine
    from paratrain.train.optim import param_groups
    from paratrain.train.parallel.zero1 import ZeroOneOptimizer

    from ..test_engine import CFG, tiny_gpt

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    try:
        dims = ParallelDims(dp=2, tp=1, pp=1, world_size=2)

        def adamw(groups):
            return torch.optim.AdamW(groups, lr=1e-2)

        def zero1(bucket_bytes: int) -> tuple[torch.nn.Module, ZeroOneOptimizer, OverlappedGradReducer]:
            model = tiny_gpt()
            reducer = OverlappedGradReducer(list(model.parameters()), dims.get_mesh("dp"), bucket_bytes, shard=True)
            return model, ZeroOneOptimizer(param_groups(model, 0.1), reducer, adamw), reducer

        model, optimizer, reducer = zero1(BUCKET_BYTES)
        optimizer.gather_in_forward(model)  # as build.py does: the gathers after a step overlap the next forward
        engine = TorchEngine(model=model, module=model, optimizer=optimizer, dims=dims, precision="fp32",
                             grad_clip=0.05, dp_reducer=reducer)  # clips: the norm must be the global one
        single = tiny_gpt()  # the single-process reference, on the whole batch
        single_engine = TorchEngine(model=single, module=single, optimizer=adamw(param_groups(single, 0.1)),
                                    dims=ParallelDims(dp=1, tp=1, pp=1, world_size=1), precision="fp32",
                                    grad_clip=0.05, dp_reducer=None)
        counts, norms, pending, others_stale = [], [], [], []
        last = reducer.buckets[0]  # the last bucket forward reads: its gather is launched last
        starts = dict(zip(map(id, last.params), [0, *itertools.accumulate(p.numel() for p in last.params)]))
        mine = torch.zeros(sum(p.numel() for p in last.params), dtype=torch.bool)  # this rank's shard of it
        for p, start, stop, _ in last.pieces(rank):
            mine[starts[id(p)] + start: starts[id(p)] + stop] = True

        def flat_last() -> torch.Tensor:
            return torch.cat([p.detach().reshape(-1) for p in last.params])
        for step in range(STEPS):
            tokens = torch.randint(CFG.vocab_size, (4, CFG.block_size + 1),
                                   generator=torch.Generator().manual_seed(step))
            x, y = tokens[:, :-1], tokens[:, 1:]
            with counted_collectives() as calls:
                engine.forward_backward([(x.chunk(2)[rank], y.chunk(2)[rank])])
                pending.append(len(optimizer._in_flight) + len(optimizer._to_gather))  # after forward: none
                before = flat_last()
                result = engine.optimizer_step(lr=1e-2)
                pending.append(len(optimizer._in_flight) + len(optimizer._to_gather))  # after the step: all
                # the step wrote this rank's shard in place; the other ranks' come with the gather forward waits for
                after = flat_last()
                others_stale.append(torch.equal(after[~mine], before[~mine])
                                    and not torch.equal(after[mine], before[mine]))
            counts.append(calls)
            single_engine.forward_backward([(x, y)])
            norms.append((result.grad_norm, single_engine.optimizer_step(lr=1e-2).grad_norm))
        optimizer.settle()  # what reads the weights outside forward does first (the engine's checkpoint does)

        share = optimizer.state_dict(model)  # what this rank hands DCP
        state = whole(share)
        reference_state = get_optimizer_state_dict(single, single_engine.optimizer)["state"]  # a plain run's
        # The same state read back by a run of other buckets (other shard boundaries), from a template of the
        # parameters it holds pieces of.
        other_model, reloaded, _ = zero1(10**9)
        template = reloaded.load_template(other_model)
        reloaded.load_state_dict(other_model, {name: state[name] for name in template})
        reloaded_state = whole(reloaded.state_dict(other_model))
        psi = sum(p.numel() for p in model.parameters())
        report = {
            "buckets": len(reducer.buckets), "counts": counts, "norms": norms, "psi": psi, "pending": pending,
            "others_stale": others_stale,
            "optimizer_bytes": engine.state_bytes()["optimizer"], "grad_bytes": engine.last_grad_bytes,
            "param_error": max((p - q).abs().max().item() for p, q in zip(model.parameters(), single.parameters())),
            "same_format": state_keys(state) == state_keys(reference_state),
            "state_error": max((state[name][key] - reference_state[name][key]).abs().max().item()
                               for name in reference_state for key in ("exp_avg", "exp_avg_sq")),
            "steps": sorted({state[name]["step"].item() for name in reference_state}),
            "reload_equal": all(torch.equal(state[n][k], reloaded_state[n][k]) for n in state for k in state[n]),
            "kept": sorted(share), "kept_bytes": sum(v.numel() * v.element_size() for values in share.values()
                                                     for v in values.values()),
            "kept_devices": sorted({str(v.device) for values in share.values() for v in values.values()}),
            "largest_bytes": max(8 * p.numel() for p in model.parameters()),
            "template": sorted(template), "names": sorted(reference_state),
            "tp_state_wraps_the_host_tensor": host_tensor_kept_as_dtensor(),
        }
        with open(f"{out}.{rank}", "w") as f:
            json.dump(report, f)
    finally:
        dist.destroy_process_group()


def host_tensor_kept_as_dtensor() -> bool:
    """Under tensor parallel the saved state is a DTensor of the parameter's placements whose local tensor is the
    host tensor itself: DTensor.from_local would copy it to the mesh's device (a GPU), the whole state with it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from paratrain.train.parallel.zero1 import like_param

    param = distribute_tensor(torch.ones(4, 3), init_device_mesh("cpu", (2,)), [Shard(0)])
    host = torch.zeros(2, 3)
    wrapped = like_param(host, param)
    return wrapped._local_tensor is host and wrapped.placements == param.placements and wrapped.shape == (4, 3)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero1")
    spawn_ranks(train, 2, str(tmp / "store"), str(tmp / "report"))
    return [json.loads((tmp / f"report.{rank}").read_text()) for rank in range(2)]


def test_each_step_reduce_scatters_and_all_gathers_once_per_bucket_and_never_broadcasts(reports):
    """The all-reduce is the global gradient norm's one scalar. A step launches the all-gathers of the first
    GATHERS_IN_FLIGHT buckets forward reads, and the next forward the rest, one bucket ahead of the layers that
    need it: the first step counts 2, every later one a whole step's (the step before's rest and its own 2)."""
    from paratrain.train.parallel.zero1 import GATHERS_IN_FLIGHT

    for report in reports:
        assert report["buckets"] > 2
        per_bucket = report["buckets"]
        counts = [{"broadcast": 0, "all_reduce": 1, "reduce_scatter_single": per_bucket, "all_gather_single": n}
                  for n in [GATHERS_IN_FLIGHT] + [per_bucket] * (STEPS - 1)]
        assert report["counts"] == counts, report["counts"]


def test_the_gathers_after_a_step_overlap_the_next_forward(reports):
    """After each step every bucket's gather is pending (2 in flight): the last bucket forward reads has this
    rank's shard updated (the step writes it in place) and the other ranks' elements not yet; forward has them all
    in before its layers run (the norms and weights of the next test hold to 1e-5)."""
    for report in reports:
        assert report["pending"] == [0, report["buckets"]] * STEPS
        assert report["others_stale"] == [True] * STEPS


def test_trains_as_adamw_on_the_whole_batch(reports):
    for report in reports:
        assert report["param_error"] < 1e-5, report
        for zero1_norm, single_norm in report["norms"]:
            assert zero1_norm == pytest.approx(single_norm, rel=1e-5)
        assert report["state_error"] < 1e-6, report  # the checkpoint's whole moments are the reference's


def test_each_rank_holds_half_the_optimizer_state_and_gradients(reports):
    """Adam's two fp32 moments, 8Ψ/2 bytes, and the 4Ψ/2 bytes of this rank's gradient shard; each bucket pads its
    flat buffer to an even length (at most one element)."""
    for report in reports:
        psi, buckets = report["psi"], report["buckets"]
        assert 8 * psi / 2 - 8 * buckets <= report["optimizer_bytes"] <= 8 * psi / 2 + 8 * buckets
        assert 4 * psi / 2 - 4 * buckets <= report["grad_bytes"] <= 4 * psi / 2 + 4 * buckets


def test_checkpoint_state_is_whole_per_parameter_and_reloads_into_other_buckets(reports):
    for report in reports:
        assert report["same_format"]  # a plain optimizer's get_optimizer_state_dict: names and keys
        assert report["steps"] == [STEPS]
        assert report["reload_equal"]


def test_each_rank_saves_its_own_half_of_the_optimizer_state_from_host_memory(reports):
    """A save gathers the whole state bucket by bucket, but each parameter's is kept (on the host) by one dp rank
    only: at 8B parameters, every GPU holding all of Adam's moments at once would need 64 GB more."""
    kept = [set(report["kept"]) for report in reports]
    assert kept[0].isdisjoint(kept[1]) and kept[0] | kept[1] == set(reports[0]["names"])
    psi, largest = reports[0]["psi"], reports[0]["largest_bytes"]
    for report in reports:
        assert report["kept_devices"] == ["cpu"]
        assert report["tp_state_wraps_the_host_tensor"]
        assert report["kept_bytes"] <= 8 * psi / 2 + largest
        # A resume reads back only the parameters this rank holds pieces of.
        assert set(report["template"]) < set(report["names"])


@pytest.mark.parametrize("numel,shards", [([5, 3, 8], 2), ([5, 3, 8], 3), ([1], 4), ([7, 1, 1], 4)])
def test_bucket_shards_cover_every_element_once(numel, shards):
    bucket = Bucket([torch.nn.Parameter(torch.zeros(n)) for n in numel], shards)
    seen = {i: [] for i in range(len(numel))}
    for shard in range(shards):
        for p, start, stop, offset in bucket.pieces(shard):
            assert 0 <= offset and offset + stop - start <= bucket.shard_numel
            seen[next(i for i, q in enumerate(bucket.params) if q is p)].extend(range(start, stop))
    assert seen == {i: list(range(n)) for i, n in enumerate(numel)}
    assert bucket.numel == bucket.shard_numel * shards >= sum(numel)

