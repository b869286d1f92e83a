"""Tensor parallel issues Megatron's number of collectives: per block, one all-reduce in forward and one in
backward for attention and for the MLP each (4 per block per step); the head, split by vocabulary, adds the loss's
two all-reduces of per-token statistics in forward (per piece of loss.CE_CHUNK_TOKENS tokens) and the sum of its
input's gradient in backward; nothing else in the model's forward and backward. Counted at the dispatcher (every
collective op issued, functional or eager) on a real 2-rank gloo group. (DTensor's CommDebugMode counts the
functional ones, but its module tracking breaks under activation checkpointing.)"""

import json

import pytest
import torch
import torch.distributed as dist

from paratrain.train.loss import cross_entropy

from ..harness import spawn_ranks

LAYERS = 3


def collective_counter():
    """A dispatch mode counting the collectives issued under it (waits aside), by op name: functional (DTensor's)
    and eager (torch.distributed's, e.g. `allreduce_`)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.counts: Counter[str] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            namespace, _, name = func._schema.name.partition("::")
            if namespace in ("_c10d_functional", "c10d") and name not in ("wait_tensor", "_wrap_tensor_autograd"):
                self.counts[name] += 1
            return func(*args, **(kwargs or {}))

    return Count()


CONFIGS = {
    "gpt": dict(vocab_size=64, block_size=16, layers=LAYERS, heads=4, embed_dim=32),
    "llama": dict(vocab_size=64, block_size=16, layers=LAYERS, heads=4, kv_heads=2, embed_dim=32, ffn_dim=64),
}


def count_collectives(rank: int, family: str, store_file: str, out: str, ac: str = "none") -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from paratrain.train.parallel.activation_checkpoint import apply_ac
    from paratrain.train.models.llama import LlamaConfig
    from paratrain.train.models.gpt import GPTConfig
    from paratrain.train.models.registry import build_model
    from paratrain.train.models.weights import init_weights
    from paratrain.train.parallel.tensor_parallel import RNGStream, apply_tp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        model = build_model({"gpt": GPTConfig, "llama": LlamaConfig}[family](**CONFIGS[family]))
        apply_tp(model, mesh, RNGStream(0, torch.device("cpu")))
        apply_ac(model, ac)
        init_weights(model, seed=1)
        tokens = torch.randint(64, (2, 17), generator=torch.Generator().manual_seed(0))
        counts = {}
        for phase in ("forward", "backward"):
            with collective_counter() as comm:
                if phase == "forward":
                    loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
                else:
                    loss.backward()
            counts[phase] = dict(comm.counts)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(counts, f)
        dist.barrier()  # neither rank leaves while the other may still talk to it (gloo aborts on a lost peer)
    finally:
        dist.destroy_process_group()


# Per step: the blocks' (functional) all-reduces, 2 per block each way; the vocabulary-parallel loss's 2 (eager)
# in forward; the head input's gradient in backward.
MEGATRON = {"forward": {"all_reduce": 2 * LAYERS, "allreduce_": 2}, "backward": {"all_reduce": 2 * LAYERS + 1}}


@pytest.mark.parametrize("family", CONFIGS)
def test_each_block_all_reduces_once_per_sublayer_in_forward_and_in_backward(family, tmp_path):
    """Llama's MLP has two input projections (gate, up) and attention three (q, k, v): still one each."""
    out = tmp_path / "counts.json"
    spawn_ranks(count_collectives, 2, family, str(tmp_path / "store"), str(out))
    counts = json.loads(out.read_text())
    assert counts == MEGATRON, counts



def test_selective_activation_checkpointing_does_not_recompute_the_collectives(tmp_path):
    """Selective AC keeps the tensor-parallel all-reduces' outputs, as torchtitan's policy does: recomputing them
    in backward would cost a collective each (3 per block instead of 2)."""
    out = tmp_path / "counts.json"
    spawn_ranks(count_collectives, 2, "llama", str(tmp_path / "store"), str(out), "selective")
    counts = json.loads(out.read_text())
    assert counts == MEGATRON, counts


def grad_norm_collectives(rank: int, store_file: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from paratrain.train.parallel.dims import ParallelDims
    from paratrain.train.engine import global_grad_norm_square
    from paratrain.train.models.llama import LlamaConfig
    from paratrain.train.models.registry import build_model
    from paratrain.train.models.weights import init_weights
    from paratrain.train.parallel.tensor_parallel import RNGStream, apply_tp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        model = build_model(LlamaConfig(**CONFIGS["llama"]))
        apply_tp(model, mesh, RNGStream(0, torch.device("cpu")))
        init_weights(model, seed=1)
        tokens = torch.randint(64, (2, 17), generator=torch.Generator().manual_seed(0))
        cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        params = list(model.parameters())
        expected = torch.sqrt(sum(torch.linalg.vector_norm(
            p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).square() for p in params)).item()
        with collective_counter() as comm:
            norm = global_grad_norm_square(params, ParallelDims(dp=1, tp=2, pp=1, world_size=2)).sqrt().item()
        # The optimizer over TP shards and plain norms alike steps with torch's fused kernel.
        from paratrain.api.spec import TrainingSpec
        from paratrain.train.optim import build_optimizer

        optimizer = build_optimizer(model, ParallelDims(dp=1, tp=2, pp=1, world_size=2), TrainingSpec())
        optimizer.step()
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"norm": norm, "expected": expected, "collectives": sum(comm.counts.values()),
                           "sharded_grads": sum(isinstance(p.grad, DTensor) for p in params),
                           "fused": optimizer.defaults["fused"]}, f)
        dist.barrier()  # neither rank leaves while the other may still talk to it (gloo aborts on a lost peer)
    finally:
        dist.destroy_process_group()


def test_the_gradient_norm_costs_one_collective_per_mesh_group_and_the_step_is_fused(tmp_path):
    out = tmp_path / "norm.json"
    spawn_ranks(grad_norm_collectives, 2, str(tmp_path / "store"), str(out))
    result = json.loads(out.read_text())
    assert result["norm"] == pytest.approx(result["expected"], rel=1e-6)
    assert result["sharded_grads"] > 4 and result["collectives"] == 1, result  # the TP-sharded grads: one all-reduce
    assert result["fused"] is True
