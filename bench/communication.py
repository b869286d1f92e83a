"""Communication per training step, by layout, counted at the dispatcher and set against the papers' formulas.

    .venv/bin/python bench/communication.py [--out bench/results/communication.json]

Every layout trains the same 4-layer, 128-wide GPT on 8 sequences of 64 tokens per step, in fp32 and in bf16,
through the trainer's own engine (DDP, DeepSpeed, FSDP2, tensor and pipeline parallel as `paratrain train` builds
them), one process per rank on gloo. One step after a first (which sets things up) runs under a dispatch mode that
records every collective and point-to-point op the step issues (torch.distributed's c10d ops and the functional
collectives DTensor uses): its kind, process group (data, tensor or pipeline) and elements. The loop's one
all-reduce of the loss and flags per step is outside the engine and not counted.

Volume is what each rank sends, as a ring sends it, in elements: an all-reduce of n elements over N ranks 2n(N-1)/N,
a reduce-scatter of n elements in, or an all-gather of n out, n(N-1)/N, a send n. The formulas, in the same unit:

- data parallel (DDP), ZeRO-1 and ZeRO-2 (the ZeRO paper): 2Ψ(N-1)/N per step, Ψ the parameters the data-parallel
  group shares (this rank's pipeline stage and tensor-parallel shard); ZeRO-3: 3Ψ(N-1)/N (its parameters are
  gathered again for backward; FSDP2 keeps the root and the last block whole, so it moves less);
- tensor parallel (Megatron-LM): 2 all-reduces of the b x s x h activations per block in forward and 2 in backward,
  4L per step and microbatch (L this stage's blocks), together 4L x 2bsh(T-1)/T;
- pipeline parallel: each stage boundary carries every microbatch's activations forward and their gradients back,
  b x s x h elements each way per step, so a rank sends bsh per neighbour.

bf16 (autocast) should halve what moves in 16 bits: activations (TP, PP: a stage sends its residual stream in
bf16), and the parameters FSDP2 gathers; the gradients DDP and FSDP2 reduce stay fp32, unless spec.reducePrecision
is bf16 (the third set of rows): then every gradient reduction (all-reduce, reduce-scatter) is half fp32's bytes,
the same elements, and the all-gathers of updated parameters are as before. Writes
bench/results/communication.json and communication.png, and the `communication` section of docs/benchmarks.md.
"""

from __future__ import annotations

from pathlib import Path

from doc_section import arguments, machine, pyplot, save_results, write_section
from jobs import engine_for, spawn

SHAPE = {"layers": 4, "heads": 4, "embedDim": 128, "blockSize": 64, "dropout": 0.0, "vocabSize": 65}
BATCH = 8
# (name, parallelism): every layout of the issue, data-parallel degree 2 wherever data parallel is in it.
LAYOUTS = [
    ("DP=2 (DDP)", {"data": 2}),
    ("DP=2 ZeRO-1 (DeepSpeed)", {"data": 2, "zeroStage": 1}),
    ("DP=2 ZeRO-2 (DeepSpeed)", {"data": 2, "zeroStage": 2}),
    ("DP=2 ZeRO-3 (DeepSpeed)", {"data": 2, "zeroStage": 3}),
    ("TP=2", {"tensor": 2}),
    ("PP=2 (1F1B, 2 microbatches)", {"pipeline": 2, "microbatches": 2}),
    ("DP=2 x TP=2 ZeRO-2 (FSDP2)", {"data": 2, "tensor": 2, "zeroStage": 2}),
    ("DP=2 x TP=2 ZeRO-3 (FSDP2)", {"data": 2, "tensor": 2, "zeroStage": 3}),
    ("DP=2 x TP=2 x PP=2 ZeRO-1 (3D)", {"data": 2, "tensor": 2, "pipeline": 2, "microbatches": 2, "zeroStage": 1}),
]
KINDS = {  # dispatcher op → (collective, how its volume per rank follows from its elements n over N ranks)
    "allreduce_": ("all-reduce", lambda n, size: 2 * n * (size - 1) / size),
    "all_reduce": ("all-reduce", lambda n, size: 2 * n * (size - 1) / size),
    "_reduce_scatter_base_": ("reduce-scatter", lambda n, size: n * (size - 1) / size),
    "reduce_scatter_tensor": ("reduce-scatter", lambda n, size: n * (size - 1) / size),
    "_allgather_base_": ("all-gather", lambda n, size: n * (size - 1) / size),
    "all_gather_into_tensor": ("all-gather", lambda n, size: n * (size - 1) / size),
    "broadcast_": ("broadcast", lambda n, size: n),
    "send": ("send", lambda n, size: n),
}
SMALL = 1024  # elements: collectives of scalars and flags (the gradient norm, an overflow check), counted apart


# (precision, reducePrecision) of each set of rows
PRECISIONS = [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16")]


def job(parallelism: dict, precision: str, reduce_precision: str = "fp32") -> dict:
    world = parallelism.get("data", 1) * parallelism.get("tensor", 1) * parallelism.get("pipeline", 1)
    return {"apiVersion": "paratrain.dev/v1alpha1", "kind": "ParallelTrainJob", "metadata": {"name": "comm"},
            "spec": {"nodes": 1, "procsPerNode": world, "parallelism": parallelism, "precision": precision,
                     "reducePrecision": reduce_precision,
                     "model": dict(SHAPE), "data": {"source": "synthetic"},
                     "training": {"steps": 10, "warmupSteps": 0, "batchSize": BATCH, "seed": 1337}}}


def collective_recorder():
    """A dispatch mode recording (op, group name, elements, bytes) of every collective and send issued under it.
    The element count is an all-gather's output and every other op's input; a recv is its sender's send."""
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[tuple[str, str, int, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            namespace, _, name = func._schema.name.partition("::")
            if namespace in ("c10d", "_c10d_functional") and name in KINDS:
                if namespace == "c10d":  # (tensors..., ProcessGroup as a TorchScript object, ...)
                    group = next(dist.ProcessGroup.unbox(a) for a in args if isinstance(a, torch.ScriptObject))
                    tensor = args[1] if name == "_reduce_scatter_base_" else args[0]  # its input (else output)
                    tensor = tensor[0] if isinstance(tensor, list) else tensor
                    group_name = group.group_name
                else:  # (input, ..., group name)
                    tensor, group_name = args[0], args[-1]
                    if name == "all_gather_into_tensor":  # (input, group size, group name): count the output
                        self.ops.append((name, group_name, tensor.numel() * args[1], tensor.element_size()))
                        return func(*args, **(kwargs or {}))
                self.ops.append((name, group_name, tensor.numel(), tensor.element_size()))
            return func(*args, **(kwargs or {}))

    return Record()


def parameters_shared_over_dp(module) -> int:
    """Ψ of the ZeRO formulas for this rank: the elements of its stage's parameters under tensor parallel's
    sharding, before any data-parallel sharding (DeepSpeed ZeRO-3 keeps the whole count as ds_numel)."""
    from torch.distributed.tensor import DTensor, Shard

    total = 0
    for p in module.parameters():
        n = getattr(p, "ds_numel", p.numel())
        if isinstance(p, DTensor):
            for dim, placement in zip(p.device_mesh.mesh_dim_names, p.placements, strict=True):
                if dim == "tp" and isinstance(placement, Shard):
                    n //= p.device_mesh[dim].size()
        total += n
    return total


def rank_step(parallelism: dict, precision: str, reduce_precision: str = "fp32") -> dict:
    """On one rank: one step, then one more under the recorder; what it issued, by mesh dimension."""
    import torch

    spec, dims, engine = engine_for(job(parallelism, precision, reduce_precision), SHAPE["vocabSize"])
    rows = BATCH // dims.dp
    x = torch.randint(0, SHAPE["vocabSize"], (rows, SHAPE["blockSize"]), generator=torch.Generator().manual_seed(0))
    engine.forward_backward([(x, x)])
    engine.optimizer_step(1e-3)
    with collective_recorder() as record:
        engine.forward_backward([(x, x)])
        engine.optimizer_step(1e-3)
    names = {dims.get_mesh(dim).get_group().group_name: dim for dim in ("dp", "tp", "pp")
             if getattr(dims, dim) > 1}
    sizes = {"dp": dims.dp, "tp": dims.tp, "pp": dims.pp}
    # DeepSpeed makes a data-parallel group of its own (the whole world, as it runs data-parallel layouts only).
    other = "dp" if dims.uses_deepspeed else "world"
    ops = [{"op": op, "dim": names.get(group, other), "elements": n, "bytes": n * width}
           for op, group, n, width in record.ops]
    return {"ops": ops, "sizes": sizes, "psi": parameters_shared_over_dp(engine.module), "rows": rows,
            "pp_rank": dims.pp_rank if dims.pp > 1 else 0}


def summarize(name: str, parallelism: dict, precision: str, rank0: dict, reduce_precision: str = "fp32") -> dict:
    """Counts and volumes per mesh dimension on rank 0, against the formulas; the bytes per element each kind of
    collective carried (`widths`)."""
    sizes, psi = rank0["sizes"], rank0["psi"]
    dims: dict[str, dict] = {}
    for op in rank0["ops"]:
        kind, volume = KINDS[op["op"]]
        size = sizes.get(op["dim"], 1)
        entry = dims.setdefault(op["dim"], {"counts": {}, "small": 0, "elements": 0.0, "bytes": 0.0, "widths": {}})
        if op["elements"] < SMALL:
            entry["small"] += 1
            continue
        entry["counts"][kind] = entry["counts"].get(kind, 0) + 1
        widths = entry["widths"].setdefault(kind, [])
        if op["bytes"] // op["elements"] not in widths:
            widths.append(op["bytes"] // op["elements"])
        entry["elements"] += volume(op["elements"], size)
        entry["bytes"] += volume(op["elements"], size) * op["bytes"] / op["elements"]
    return {"layout": name, "precision": precision, "reduce_precision": reduce_precision,
            "parallelism": parallelism, "psi": psi, "per_dim": dims,
            "formula": formula(parallelism, psi, rank0), "total_bytes": sum(d["bytes"] for d in dims.values())}


def formula(parallelism: dict, psi: int, rank0: dict) -> dict:
    """Elements each rank sends per step, by mesh dimension, as the papers count them."""
    out = {}
    dp, tp, pp = (parallelism.get(k, 1) for k in ("data", "tensor", "pipeline"))
    if dp > 1:
        out["dp"] = (3 if parallelism.get("zeroStage", 0) == 3 else 2) * psi * (dp - 1) / dp
    activation = rank0["rows"] * SHAPE["blockSize"] * SHAPE["embedDim"]
    if tp > 1:  # 4 all-reduces per block of this stage and microbatch, together the whole batch's activations
        out["tp"] = 4 * (SHAPE["layers"] // pp) * 2 * activation * (tp - 1) / tp
    if pp > 1:
        out["pp"] = activation  # rank 0 is stage 0: it sends every microbatch's activations forward
    return out


def measure(name: str, parallelism: dict, precision: str, reduce_precision: str = "fp32") -> dict:
    world = parallelism.get("data", 1) * parallelism.get("tensor", 1) * parallelism.get("pipeline", 1)
    rank0 = spawn(rank_step, world, parallelism, precision, reduce_precision)[0]
    return summarize(name, parallelism, precision, rank0, reduce_precision)


def label(row: dict) -> str:
    return row["precision"] + (f", reduce {row['reduce_precision']}" if row["reduce_precision"] != "fp32" else "")


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    names = [r["layout"] for r in rows if r["precision"] == "fp32"]
    labels = list(dict.fromkeys(label(r) for r in rows))
    height = 0.8 / len(labels)
    for k, name in enumerate(labels):
        got = {r["layout"]: r for r in rows if label(r) == name}
        ax.barh([i + (k - (len(labels) - 1) / 2) * height for i in range(len(names))],
                [got[n]["total_bytes"] / 2**20 if n in got else 0 for n in names], height, label=name)
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("MiB each rank sends per step (rank 0)")
    ax.set_title("Communication per step by layout")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = arguments(__doc__, "communication")
    args = parser.parse_args()

    rows = []
    for precision, reduce_precision in PRECISIONS:
        for name, parallelism in LAYOUTS:
            if reduce_precision != "fp32" and parallelism.get("data", 1) == 1:
                continue  # nothing to reduce over data parallel
            row = measure(name, parallelism, precision, reduce_precision)
            rows.append(row)
            print(f"{name} {label(row)}: " + "; ".join(
                f"{dim}: {entry['counts']} + {entry['small']} small, {entry['elements']:,.0f} elements "
                f"(formula {row['formula'].get(dim, 0):,.0f})" for dim, entry in row["per_dim"].items()), flush=True)
    result = {"shape": SHAPE, "batch": BATCH, "rows": rows, "machine": machine()}
    save_results(result, args.out, lambda png: plot(rows, png))
    if not args.no_doc:
        write_section("communication", doc_lines(result))


def doc_lines(result: dict) -> list[str]:
    table = []
    for r in result["rows"]:
        for dim, entry in r["per_dim"].items():
            expected = r["formula"].get(dim)
            if not entry["counts"] and not expected:  # only scalars (3D's gradient norm over the world)
                continue
            counts = ", ".join(f"{n} {kind}" for kind, n in entry["counts"].items()) or "none"
            ratio = f"{entry['elements'] / expected:.2f}x" if expected else "(no formula)"
            table.append(f"| {r['layout']} | {label(r)} | {dim} | {counts} | {entry['small']} | "
                         f"{entry['elements']:,.0f} | {f'{expected:,.0f}' if expected else '-'} | {ratio} | "
                         f"{entry['bytes'] / 2**20:.2f} |")
    return [f"`.venv/bin/python bench/communication.py` ({result['machine']}; rank 0, one step):", "",
            "| layout | precision | group | collectives | small ones | elements sent | formula | measured / "
            "formula | MiB sent |", "|---|---|---|---|---|---|---|---|---|", *table, "",
            "![communication per step](../bench/results/communication.png)"]


if __name__ == "__main__":
    main()
