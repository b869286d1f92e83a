"""The loss (loss.py): pieces of CE_CHUNK_TOKENS tokens, each with its gradient, give torch's whole-batch
cross-entropy and its gradient; logits sharded by vocabulary over a tensor-parallel group give every rank the same."""

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from paratrain.train import loss

from .harness import spawn_ranks


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2), (torch.float16, 1e-3)])
def test_the_loss_in_pieces_gives_torchs_loss_and_gradient(dtype, rtol, monkeypatch):
    """loss.cross_entropy over 3 pieces (7, 7 and 6 tokens) against torch's whole-batch cross-entropy in fp32:
    the same loss, and the same gradient through a scaled backward (a loss scale and an accumulation weight), for
    logits in each training dtype; fp16's gradient does not underflow where the scale lifts it."""
    monkeypatch.setattr(loss, "CE_CHUNK_TOKENS", 7)
    torch.manual_seed(0)
    raw, targets = torch.randn(2, 10, 50) * 3, torch.randint(50, (2, 10))
    ours, theirs = raw.to(dtype).requires_grad_(), raw.to(dtype).requires_grad_()
    scale = 2.0**16 / 3
    (loss.cross_entropy(ours, targets) * scale).backward()
    expected = F.cross_entropy(theirs.flatten(0, 1).float(), targets.flatten())
    (expected * scale).backward()
    with torch.no_grad():
        torch.testing.assert_close(loss.cross_entropy(ours, targets), expected, rtol=1e-6, atol=1e-6)
    assert ours.grad.dtype == dtype
    torch.testing.assert_close(ours.grad.float(), theirs.grad.float(), rtol=rtol, atol=rtol * 1e-2 * scale)
    tiny = raw.clone()
    tiny[0, 0] = torch.tensor([40.0] + [0.0] * 49)  # softmax ~4e-18 on 49 entries: under fp16 before the scale
    lifted = tiny.to(dtype).requires_grad_()
    (loss.cross_entropy(lifted, targets) * 2.0**40).backward()
    if dtype == torch.float16:
        assert (lifted.grad[0, 0, 1:].float() != 0).all()


def vocab_parallel_loss(rank: int, store_file: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    try:
        loss.CE_CHUNK_TOKENS = 7  # 3 pieces
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        results = {}
        for dtype in (torch.float32, torch.bfloat16):
            raw = torch.randn(2, 10, 65, generator=torch.Generator().manual_seed(0)) * 3
            targets = torch.randint(65, (2, 10), generator=torch.Generator().manual_seed(1))
            whole = raw.to(dtype).requires_grad_()
            expected = F.cross_entropy(whole.float().flatten(0, 1), targets.flatten())
            expected.backward()
            sharded = distribute_tensor(raw.to(dtype), mesh, [Shard(2)]).requires_grad_()  # 33 and 32 columns
            value = loss.cross_entropy(sharded, targets)
            value.backward()
            with torch.no_grad():
                evaluated = loss.cross_entropy(sharded, targets)
            grad = sharded.grad.full_tensor()
            results[str(dtype)] = {"loss": value.item(), "evaluated": evaluated.item(), "expected": expected.item(),
                                   "grad_error": (grad.float() - whole.grad.float()).abs().max().item(),
                                   "local_columns": sharded.to_local().shape[-1]}
        with open(f"{out}.{rank}", "w") as f:
            json.dump(results, f)
        dist.barrier()  # neither rank leaves while the other may still talk to it (gloo aborts on a lost peer)
    finally:
        dist.destroy_process_group()


def test_logits_sharded_by_vocabulary_give_every_rank_the_whole_loss_and_its_gradient(tmp_path):
    """65 columns over 2 ranks (33 and 32: uneven), 20 tokens in pieces of 7, targets on both ranks' columns."""
    out = tmp_path / "loss.json"
    spawn_ranks(vocab_parallel_loss, 2, str(tmp_path / "store"), str(out))
    ranks = [json.loads(out.with_name(f"loss.json.{rank}").read_text()) for rank in (0, 1)]
    assert [r[str(torch.float32)]["local_columns"] for r in ranks] == [33, 32]
    for dtype, grad_tolerance in ((torch.float32, 1e-7), (torch.bfloat16, 2e-4)):
        for result in (r[str(dtype)] for r in ranks):
            assert result["loss"] == pytest.approx(result["expected"], rel=1e-6), result
            assert result["evaluated"] == pytest.approx(result["expected"], rel=1e-6), result
            assert result["grad_error"] <= grad_tolerance, result  # softmax/count: entries under 0.05
