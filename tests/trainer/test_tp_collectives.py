"""Tensor parallel issues Megatron's number of collectives: per block, one all-reduce in forward and one in
backward for attention and for the MLP each (4 per block per step), and nothing else in the model's forward and
backward. Counted with DTensor's CommDebugMode on a real 2-rank gloo group."""

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

LAYERS = 3


CONFIGS = {
    "gpt": dict(vocab_size=64, block_size=16, layers=LAYERS, heads=4, embed_dim=32),
    "llama": dict(vocab_size=64, block_size=16, layers=LAYERS, heads=4, kv_heads=2, embed_dim=32, ffn_dim=64),
}


def count_collectives(rank: int, family: str, store_file: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from paratrain.train.llama import LlamaConfig
    from paratrain.train.model import GPTConfig
    from paratrain.train.models import build_model, init_weights
    from paratrain.train.tensor_parallel import RNGStream, apply_tp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        model = build_model({"gpt": GPTConfig, "llama": LlamaConfig}[family](**CONFIGS[family]))
        apply_tp(model, mesh, RNGStream(0, torch.device("cpu")))
        init_weights(model, seed=1)
        tokens = torch.randint(64, (2, 17), generator=torch.Generator().manual_seed(0))
        counts = {}
        for phase in ("forward", "backward"):
            with CommDebugMode() as comm:
                if phase == "forward":
                    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
                else:
                    loss.backward()
            counts[phase] = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
        if rank == 0:
            with open(out, "w") as f:
                json.dump(counts, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family", CONFIGS)
def test_each_block_all_reduces_once_per_sublayer_in_forward_and_in_backward(family, tmp_path):
    """Llama's MLP has two input projections (gate, up) and attention three (q, k, v): still one each."""
    out = tmp_path / "counts.json"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(count_collectives, args=(family, str(tmp_path / "store"), str(out)), nprocs=2,
                       start_method="spawn")
    counts = json.loads(out.read_text())
    assert counts == {"forward": {"all_reduce": 2 * LAYERS}, "backward": {"all_reduce": 2 * LAYERS}}, counts

