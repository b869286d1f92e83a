"""A training script of your own, run by a ParallelTrainJob's spec.entrypoint (examples/own-script.yaml):
plain PyTorch DDP, started by torchrun, which finds its flags in the PET_* env the pods (and `paratrain run`) set.

It shows the contract a program meets to use paratrain's gang:
- the layout arrives as env (PARATRAIN_DATA, PARATRAIN_TENSOR, PARATRAIN_PIPELINE, PARATRAIN_ZERO_STAGE,
  PARATRAIN_PRECISION); this one is data parallel only and refuses anything else with exit code 2, which the
  operator treats as permanent (no restart);
- a gang restart runs it again from the start: it resumes from its last checkpoint on the shared volume;
- a stopped pod (a drain, a preemption, a suspend: SIGTERM) loses at most the step in flight: the ranks agree on
  the stop in the all-reduce each step makes anyway, save that step, and exit 76, which the operator does not count
  against backoffLimit;
- progress through paratrain.progress (optional), so Step, Loss and the ETA show in `kubectl get ptj`.

    torchrun --nproc-per-node 2 examples/own-script/train.py --data examples/data/tinyshakespeare.txt   # alone
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from paratrain.progress import Progress


class CharModel(nn.Module):
    """A small causal Transformer over characters."""

    def __init__(self, vocab: int, block: int, width: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(block, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        h = self.tokens(x) + self.positions(torch.arange(x.shape[1], device=x.device))
        return self.head(self.blocks(h, mask=mask, is_causal=True))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True, help="a UTF-8 text file")
    parser.add_argument("--checkpoint-dir", help="where to save and resume from (a shared volume in a cluster)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step, over all ranks")
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    args = parser.parse_args()

    if os.environ.get("PARATRAIN_TENSOR", "1") != "1" or os.environ.get("PARATRAIN_PIPELINE", "1") != "1":
        print("this script is data parallel only: set parallelism.tensor and pipeline to 1", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if args.batch_size % world:
        print(f"--batch-size {args.batch_size} is not divisible by the {world} ranks", file=sys.stderr)
        return 2

    text = Path(args.data).read_text()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text], dtype=torch.long)
    torch.manual_seed(1337)
    model = CharModel(len(chars), args.block).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = 0
    checkpoint = Path(args.checkpoint_dir) / "latest.pt" if args.checkpoint_dir else None
    if checkpoint and checkpoint.exists():  # a restarted gang continues where the last checkpoint left off
        state = torch.load(checkpoint, map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        if rank == 0:
            print(f"resume step={start} from {checkpoint}", flush=True)
    ddp = DistributedDataParallel(model)
    per_rank = args.batch_size // world
    stop = {"asked": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(asked=True))

    def save(done: int) -> None:
        if checkpoint and rank == 0:
            checkpoint.parent.mkdir(parents=True, exist_ok=True)
            partial = checkpoint.with_suffix(".tmp")  # written whole, then renamed: a crash never leaves half
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": done}, partial)
            partial.replace(checkpoint)
            print(f"checkpoint step={done}", flush=True)

    with Progress(args.steps, start_step=start) as progress:
        for step in range(start, args.steps):
            generator = torch.Generator().manual_seed(step * world + rank)  # each rank its own sequences
            starts = torch.randint(len(data) - args.block - 1, (per_rank,), generator=generator)
            x = torch.stack([data[s:s + args.block] for s in starts.tolist()]).to(device)
            y = torch.stack([data[s + 1:s + 1 + args.block] for s in starts.tolist()]).to(device)
            loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            # The loss and "was this rank told to stop?" in one all-reduce: every rank stops at the same step.
            reduced = torch.stack([loss.detach(), torch.tensor(float(stop["asked"]), device=device)])
            dist.all_reduce(reduced)
            mean_loss, stopping = reduced[0].item() / world, reduced[1].item() > 0
            progress.step(step + 1, loss=mean_loss, tokens=args.batch_size * args.block)
            done = step + 1
            if stopping and done < args.steps:
                save(done)
                dist.barrier()
                print(f"stopped at step {done}", flush=True)
                return 76  # paratrain's "preempted": the gang restarts from here, uncounted
            if done % args.checkpoint_every == 0 or done == args.steps:
                save(done)
            if rank == 0 and done % 50 == 0:
                print(f"step {done}/{args.steps} loss {mean_loss:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
