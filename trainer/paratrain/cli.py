"""`paratrain` command line.

    paratrain run JOB.yaml [--set spec.parallelism.data=2 ...] [--metrics-out m.json]   # local gang of processes
    paratrain validate JOB.yaml [--set ...]                                             # every problem, exit 1
    paratrain render JOB.yaml [--set ...] [--namespace NS]                              # the gang's k8s objects
    paratrain prepare --train-bpe 2048 --out DIR FILES...                               # text/JSONL -> token shards
    paratrain export JOB.yaml --checkpoint DIR --out HF_DIR                             # -> Hugging Face model
    paratrain crd                                                                       # the CRD manifest
    paratrain node --spec JOB.yaml                                                      # what each pod runs
    paratrain train --spec JOB.yaml                                                     # what each process runs
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .api import Problem, Spec, SpecError, load_job
from .api.shapes import parameter_count
from .contract import EXIT_INVALID_SPEC
from .token_shards import DEFAULT_SHARD_TOKENS, DEFAULT_VAL_FRACTION


def describe_model(spec: Spec) -> str:
    """`llama, 1,235,814,400 parameters` (synthetic data: its vocabSize), or the count outside the embedding and
    head and what each vocabulary entry adds, where the vocabulary comes from the data."""
    m = spec.model
    if spec.data.source == "synthetic":
        return f"{m.family}, {parameter_count(m, m.vocab_size):,} parameters"
    return (f"{m.family}, {parameter_count(m, 0):,} parameters + {2 * m.embed_dim:,} per vocabulary entry "
            "(the vocabulary comes from the data)")


def _add_job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="ParallelTrainJob YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override a field, value read as a YAML scalar (e.g. spec.parallelism.data=2); repeatable")


def _add_platform_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--platform", metavar="FILE", help="judge the job as an operator started with --platform FILE "
                   "would (host access allowed, NetworkPolicy); default: the restricted profile and a NetworkPolicy")


def _platform(args: argparse.Namespace):
    from .api.platform import Platform, load_platform

    return load_platform(args.platform) if args.platform else Platform()


def _verdicts(job, platform, out) -> bool:
    """Print what `paratrain run` here and the operator in a cluster would each do with the job; whether either
    would run it."""
    from .launch import cluster_notes, data_vocab, map_volumes, missing_data, planned_here, preflight

    here = []
    try:
        local, volumes = map_volumes(job, Path("runs") / job.metadata.name, [], create=False)
        if local.spec.parallelism.mode == "auto" and not missing_data(local, volumes):
            local = planned_here(local, data_vocab(local))  # the plan `paratrain run` would run here
        preflight(local, checksums=False, volumes=volumes)  # validate has hashed the shards already (broken_data)
    except SpecError as exc:
        here = exc.problems
    from .api.platform import as_the_operator_takes_it

    there, filled = [], []
    try:
        _, filled = as_the_operator_takes_it(job, platform)
    except SpecError as exc:
        there = exc.problems
    for target, problems in (("here (paratrain run)", here), ("in a cluster (the operator)", there)):
        verdict = "runs" if not problems else "refused: " + "; ".join(str(p) for p in problems)
        print(f"  {target}: {verdict}", file=out)
    if filled:
        print(f"  note, in a cluster: the platform's jobDefaults fill {', '.join(filled)}", file=out)
    if not there:
        for note in cluster_notes(job):
            print(f"  note, in a cluster: {note}", file=out)
    return not here or not there


def _memory(job, args: argparse.Namespace, here_vocab: int | None) -> int:
    """The per-rank memory model (printed with --memory), held to --gpu-memory or spec.resources.gpuMemory;
    `here_vocab`: the vocabulary of the data where it is on this machine."""
    from .api.memory import Headroom, fit_problem, human, parse_bytes, predict

    try:
        given = args.gpu_memory or job.spec.resources.gpu_memory
        limit = parse_bytes(given) if given else None
    except ValueError as exc:
        raise SpecError([Problem("--gpu-memory", str(exc))]) from None
    vocab = args.vocab_size or here_vocab or job.spec.data.vocab_size
    if vocab is None and not args.memory:  # only spec.resources.gpuMemory asked for the check: the ranks make it
        print("note: spec.resources.gpuMemory: not checked here, the data (and its vocabulary) is not on this machine "
              "(spec.data.vocabSize or --memory --vocab-size N give it); every rank checks it once it has read the "
              "data", file=sys.stderr)
        return 0
    if vocab is None:  # not a verdict on the job: the exit code stays the verdict's
        how = ("a character-level job's vocabulary is its text's distinct characters: give their count with "
               "--vocab-size N (65 for examples/data/tinyshakespeare.txt)" if job.spec.data.source == "text" else
               "give it with --vocab-size N or spec.data.vocabSize (128256 for Llama 3's tokenizer)")
        print(f"note: --memory: not predicted: the vocabulary comes from the data ({job.spec.data.path}), which is "
              f"not on this machine; {how}", file=sys.stderr)
        return 0
    ranks = predict(job.spec, vocab)
    headroom = Headroom.of(job.spec)
    problem = fit_problem(ranks, limit, headroom) if limit is not None else None
    if args.json:
        print(json.dumps({"limit_bytes": limit, "reserve_bytes": headroom.reserve_bytes,
                          "fragmentation": headroom.fragmentation,
                          "usable_bytes": headroom.usable(limit) if limit is not None else None,
                          "fits": problem is None, "ranks": [
            {"rank": r.rank, "stage": r.stage, "peak_bytes": r.peak_bytes,
             "terms": {k: v for k, v in r.terms.items() if not k.startswith("_")}} for r in ranks]}, indent=1))
    elif args.memory:
        shown: set[int] = set()
        for r in ranks:  # ranks of one pipeline stage hold the same: one line each
            if r.stage in shown:
                continue
            shown.add(r.stage)
            same = [x.rank for x in ranks if x.stage == r.stage]
            who = f"rank {same[0]}" if len(same) == 1 else f"ranks {same[0]}-{same[-1]}"
            terms = ", ".join(f"{k} {human(v)}" for k, v in r.terms.items() if not k.startswith("_") and v)
            print(f"{who} (stage {r.stage}): peak {human(r.peak_bytes)}: {terms}")
    if problem:
        print(f"paratrain: {'--gpu-memory' if args.gpu_memory else 'spec.resources.gpuMemory'}: {problem}",
              file=sys.stderr)
        return 1
    if limit is not None and args.memory and not args.json:
        print(f"fits in {headroom.describe(limit)}, per device")
    return 0


def _explain(job, args: argparse.Namespace, here_vocab: int | None) -> int:
    """The planner's verdict on the job's model and batch (`--explain`): exit 1 where no layout is feasible."""
    from .api import hardware, planner
    from .api import spec as spec_module

    spec = job.spec
    vocab = args.vocab_size or here_vocab or spec.data.vocab_size
    if vocab is None:
        raise SpecError([Problem("--explain", f"the vocabulary comes from the data ({spec.data.path}), which is not "
                                 "on this machine: give it with --vocab-size N")])
    profile = _platform(args).planner  # the links and compute efficiency the platform states, as the operator plans
    try:
        gpu = profile.calibrated(hardware.accelerator(args.gpu)) if args.gpu else None
    except ValueError as exc:
        raise SpecError([Problem("--gpu", str(exc))]) from None
    if gpu is None and spec.resources.gpus_per_node:
        raise SpecError([Problem("--gpu", "a GPU job is planned for a GPU: name it (one of "
                                 f"{', '.join(hardware.BY_NAME)})")])
    if args.memory_headroom is not None and not 0 <= args.memory_headroom < 1:
        raise SpecError([Problem("--memory-headroom", f"{args.memory_headroom} is not a share in [0, 1)")])
    allow = _names(args.allow, planner.MODES, "--allow") if args.allow is not None else None
    pin = _names(args.pin, spec_module.PINNABLE, "--pin") if args.pin is not None else None
    target = planner.Target(gpu, f"--gpu {gpu.name}") if gpu else planner.Target(hardware.CPU, "CPU ranks")
    result = planner.plan_job(spec, vocab, target, args.nodes, args.objective, allow, pin, args.memory_headroom)
    if args.json:
        print(json.dumps(planner.as_json(result), indent=1))
    else:
        print("\n".join(planner.explain(result, spec, spec.training.batch_size * spec.model.block_size)))
    return 0 if result.chosen else 1


def _planned_for_render(job, args: argparse.Namespace):
    """A mode auto job as the operator would render it on --gpu's nodes (CPU pods: on CPUs), its plan on stderr."""
    from .api import hardware, planner

    if job.spec.resources.gpus_per_node and not args.gpu:
        raise SpecError([Problem("--gpu", "a mode auto GPU job is rendered as planned for a GPU: name the cluster's "
                                 f"(one of {', '.join(hardware.BY_NAME)})")])
    profile = _platform(args).planner
    try:
        target = (planner.Target(profile.calibrated(hardware.accelerator(args.gpu)), f"--gpu {args.gpu}")
                  if job.spec.resources.gpus_per_node
                  else planner.Target(hardware.CPU, "CPU pods (resources.gpusPerNode 0)"))
        spec, result = planner.planned(job.spec, planner.stated_vocab(job.spec), target)
    except ValueError as exc:  # NoPlan, or a GPU the catalogue lacks
        raise SpecError([Problem("--gpu" if "paratrain knows" in str(exc) else "spec.parallelism", str(exc))]) \
            from None
    print(f"paratrain: planned for {target.source}: {result.chosen.describe()}", file=sys.stderr)
    return job.model_copy(update={"spec": spec})


def _names(given: str | None, known: tuple[str, ...], flag: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in (given or "").split(",") if n.strip())
    if unknown := [n for n in names if n not in known]:
        raise SpecError([Problem(flag, f"{', '.join(unknown)}: not one of {', '.join(known)}")])
    return names


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paratrain", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a job locally as processes (no cluster needed)")
    _add_job_args(run)
    run.add_argument("--metrics-out", help="write losses, val loss, tokens/s, per-rank state bytes and peak memory, "
                     "FLOPs and MFU as JSON")
    run.add_argument("--peak-flops", type=float, metavar="FLOPS",
                     help="one device's peak FLOP/s, for the metrics' mfu (GPUs in paratrain's table need none)")
    run.add_argument("--measure-memory", action="store_true",
                     help="on CPU, also measure each rank's peak bytes of live tensors (the metrics' "
                     "peak_tensor_bytes, counted by a dispatch mode that slows training several times); GPUs always do")
    run.add_argument("--workdir", help="where the ranks' logs, events and spec copy go (default: ./runs/<name>); "
                     "relative paths in the job (data, checkpoints) stay relative to the current directory")
    run.add_argument("--no-progress", action="store_true", help="plain log lines instead of a live progress bar")
    run.add_argument("--mount", action="append", default=[], metavar="NAME=DIR",
                     help="the local directory of spec.pod.volumes entry NAME (default: WORKDIR/volumes/NAME); "
                     "spec paths under its mountPath point there, so a cluster job runs here unchanged")

    validate = sub.add_parser("validate", help="check a job and print every problem")
    _add_job_args(validate)
    _add_platform_arg(validate)
    validate.add_argument("--memory", action="store_true",
                          help="also print each rank's predicted peak memory, split into terms (docs/trainer.md)")
    validate.add_argument("--gpu-memory", metavar="BYTES",
                          help="with --memory: a device's memory (e.g. 80GiB); exit 1 if a rank's peak exceeds it")
    validate.add_argument("--json", action="store_true",
                          help="with --memory or --explain: the prediction (or the plan) as JSON on stdout")
    validate.add_argument("--vocab-size", type=int, metavar="N",
                          help="with --memory or --explain: the data's vocabulary, where the data is not on this "
                          "machine")
    validate.add_argument("--explain", action="store_true",
                          help="plan the layout of this model and batch: every legal layout predicted for memory "
                          "and step time, the fastest that fits, the next best and every rejection (docs/trainer.md)")
    validate.add_argument("--gpu", metavar="NAME", help="with --explain: the GPU to plan for (e.g. H100-80GB; "
                          "default for a CPU job: its CPU ranks)")
    validate.add_argument("--nodes", type=int, metavar="N", help="with --explain: nodes to plan for (default: "
                          "spec.nodes; of spec.procsPerNode ranks each)")
    validate.add_argument("--objective", choices=("throughput", "minGPUs"),
                          help="with --explain: the shortest step, or the fewest nodes (up to --nodes) that fit "
                          "(default: a mode auto job's parallelism.objective, else throughput)")
    validate.add_argument("--memory-headroom", type=float, metavar="F",
                          help="with --explain: the share of a rank's usable memory kept free (default: a mode auto "
                          "job's parallelism.memoryHeadroom, else 0.15, the memory model's tested error)")
    validate.add_argument("--allow", metavar="MODES", help="with --explain: the modes the plan may use (default: a "
                          "mode auto job's parallelism.allow, else all), comma-separated, of data,tensor,pipeline,"
                          "zero,activationCheckpointing,gradientAccumulation")
    validate.add_argument("--pin", metavar="FIELDS", help="with --explain: fields kept as the job has them (default: "
                          "a mode auto job's parallelism.pin), comma-"
                          "separated, of data,tensor,pipeline,zeroStage,pipelineSchedule,microbatches,"
                          "activationCheckpointing,gradientAccumulation")

    render = sub.add_parser("render", help="print the Kubernetes objects the operator creates for a job")
    _add_job_args(render)
    render.add_argument("--namespace", help="default: the job's metadata.namespace, else `default`")
    render.add_argument("--attempt", type=int, default=0, help="gang restart attempt to render")
    render.add_argument("--gpu", metavar="NAME", help="a mode auto GPU job: the cluster's GPU to plan for (e.g. "
                        "H100-80GB), as the operator reads it from the nodes' labels")
    _add_platform_arg(render)

    prepare = sub.add_parser("prepare", help="tokenize text and JSONL files into a token directory "
                             "(spec.data.source: tokens)")
    prepare.add_argument("inputs", nargs="+", type=Path, metavar="FILE",
                         help='training inputs: UTF-8 text (one document each) or .jsonl (a "text" field a line)')
    tokenizer = prepare.add_mutually_exclusive_group(required=True)
    tokenizer.add_argument("--tokenizer", type=Path, metavar="TOKENIZER_JSON",
                           help="a Hugging Face tokenizer.json (local file)")
    tokenizer.add_argument("--train-bpe", type=int, metavar="VOCAB",
                           help="train a byte-level BPE of this vocabulary on the training inputs")
    prepare.add_argument("--out", required=True, type=Path, metavar="DIR", help="the token directory to write")
    held_out = prepare.add_mutually_exclusive_group()
    held_out.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION, metavar="F",
                          help="the last F of the token stream is the validation split "
                          f"(default {DEFAULT_VAL_FRACTION})")
    held_out.add_argument("--val", nargs="+", type=Path, default=[], metavar="FILE",
                          help="validation inputs, instead of holding out part of the training inputs")
    prepare.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, metavar="N",
                         help=f"tokens per shard file (default {DEFAULT_SHARD_TOKENS:,})")
    prepare.add_argument("--eos", metavar="TOKEN", help="the end-of-document token of a --tokenizer (default: the "
                         "first of its <|endoftext|>, <|end_of_text|>, </s>, <eos>)")
    prepare.add_argument("--no-progress", action="store_true", help="no progress bar (none either when stderr is "
                         "not a terminal)")

    export = sub.add_parser("export", help="write a checkpoint of a job, from any layout, as a Hugging Face model "
                            "directory (LlamaForCausalLM or GPT2LMHeadModel)")
    _add_job_args(export)
    export.add_argument("--checkpoint", type=Path, metavar="DIR",
                        help="a step-* checkpoint, or a checkpoint directory (its newest complete checkpoint); "
                        "default: the job's checkpoint.path as `paratrain run` writes it (runs/<name>/volumes)")
    export.add_argument("--out", required=True, type=Path, metavar="HF_DIR",
                        help="where config.json, model.safetensors (or its shards and index) and tokenizer.json "
                        "(token data) go")
    export.add_argument("--max-shard-size", default="5GB", metavar="BYTES",
                        help="the most one weights file holds (default 5GB, as transformers' save_pretrained); "
                        "larger models are written as shards with model.safetensors.index.json")
    export.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="the weights' type on disk (default fp32, as trained; bf16 halves the files)")

    sub.add_parser("crd", help="print the ParallelTrainJob CustomResourceDefinition")

    train = sub.add_parser("train", help="the trainer entrypoint every process runs (reads torchrun's env)")
    train.add_argument("--spec", required=True, help="ParallelTrainJob YAML")

    node = sub.add_parser("node", help="what a pod runs: torchrun (flags from PET_* env) starting `train`, or your "
                          "own program, once per GPU, with the workers' exit code passed through")
    node.add_argument("--spec", help="ParallelTrainJob YAML: run the built-in trainer")
    node.add_argument("program", nargs=argparse.REMAINDER, metavar="-- PROGRAM [ARG ...]",
                      help="run this instead (spec.entrypoint: [paratrain, node, --, python, train.py])")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "crd":
            import yaml

            from .api.crd import crd_manifest

            sys.stdout.write(yaml.safe_dump(crd_manifest(), sort_keys=False, allow_unicode=True))
            return 0
        if args.command == "train":
            from .train.entrypoint import exit_now, train_main

            exit_now(train_main(args.spec))
        if args.command == "prepare":
            return _prepare(args)
        if args.command == "node":
            from .node import node_main

            program = args.program[1:] if args.program[:1] == ["--"] else args.program
            if bool(args.spec) == bool(program):
                raise SpecError([Problem("paratrain node", "give --spec JOB.yaml (the built-in trainer) or "
                                         "-- PROGRAM [ARG ...] (your own), not both")])
            return node_main(program, spec_path=args.spec)
        job = load_job(args.job, args.overrides)
        if args.command == "validate":
            from .launch import broken_data, data_vocab

            if broken := broken_data(job):  # here, and broken: an error wherever it is meant to run
                raise SpecError(broken)
            try:
                here_vocab = data_vocab(job)  # read as a rank reads it, where it is on this machine
            except ValueError as exc:  # too small to train on: the job's own problem, before any verdict
                raise SpecError([Problem("spec.data.path", str(exc).removeprefix("data: "))]) from None
            out = sys.stderr if args.json else sys.stdout
            own = job.spec.entrypoint
            trains = f"its own program: {' '.join(own.command + own.args)}" if own else describe_model(job.spec)
            print(f"{args.job}: valid ({job.metadata.name}, world size {job.spec.world_size}, {trains})", file=out)
            runs_somewhere = _verdicts(job, _platform(args), out)
            if args.explain:
                return _explain(job, args, here_vocab)
            if job.spec.parallelism.mode == "auto":
                if args.memory:
                    raise SpecError([Problem("--memory", "a mode auto job's layout is the planner's: --explain "
                                             "predicts the memory of the layout it chooses")])
                return 0 if runs_somewhere else 1
            code = _memory(job, args, here_vocab) if args.memory or job.spec.resources.gpu_memory else 0
            return code or (0 if runs_somewhere else 1)
        if args.command == "render":
            from paratrain_operator.render import render_job, to_yaml_stream

            from .api.platform import as_the_operator_takes_it

            platform = _platform(args)
            job, _ = as_the_operator_takes_it(job, platform)  # what the operator would refuse, render refuses too
            if job.spec.parallelism.mode == "auto":
                job = _planned_for_render(job, args)
            namespace = args.namespace or job.metadata.namespace or "default"
            sys.stdout.write(to_yaml_stream(render_job(job, namespace=namespace, attempt=args.attempt,
                                                       platform=platform)))
            return 0
        if args.command == "export":
            if job.spec.entrypoint:
                raise SpecError([Problem("spec.entrypoint", "the job trains with its own program: export reads the "
                                         "built-in trainer's checkpoints")])
            return _export(job, args)
        from .launch import run_local

        return run_local(job, metrics_out=args.metrics_out, workdir=args.workdir, progress=not args.no_progress,
                         peak_flops=args.peak_flops, measure_memory=args.measure_memory, mounts=args.mount)
    except SpecError as exc:
        print(f"paratrain: {exc}", file=sys.stderr)
        return 1 if args.command != "train" else EXIT_INVALID_SPEC


def _export(job, args: argparse.Namespace) -> int:
    from .launch import map_volumes
    from .train.export import export_checkpoint

    checkpoint = args.checkpoint
    if checkpoint is None:
        local, _ = map_volumes(job, Path("runs") / job.metadata.name, [], create=False)
        if not local.spec.checkpoint.path:
            raise SpecError([Problem("--checkpoint", "the job sets no spec.checkpoint.path: name the checkpoint")])
        checkpoint = Path(local.spec.checkpoint.path)
    from .api.memory import parse_bytes

    try:
        max_shard_bytes = parse_bytes(args.max_shard_size)
    except ValueError as exc:
        raise SpecError([Problem("--max-shard-size", str(exc))]) from None
    try:
        out, ckpt, manifest = export_checkpoint(job, checkpoint, args.out, max_shard_bytes, args.dtype)
    except ValueError as exc:  # CheckpointError, or a checkpoint of another model than the job's
        print(f"paratrain export: {exc}", file=sys.stderr)
        return 1
    print(f"paratrain export: step {manifest.get('step')} ({ckpt}, written by layout {manifest.get('layout')}) -> "
          f"{out} ({', '.join(sorted(p.name for p in out.iterdir()))})")
    return 0


def _prepare(args: argparse.Namespace) -> int:
    import time

    from .prepare import PrepareError, prepare

    started = time.monotonic()
    try:
        m = prepare(args.out, args.inputs, tokenizer_file=args.tokenizer, bpe_vocab=args.train_bpe,
                    val_fraction=args.val_fraction, val_inputs=args.val, shard_tokens=args.shard_tokens,
                    eos=args.eos, progress=not args.no_progress and sys.stderr.isatty())
    except PrepareError as exc:
        print(f"paratrain prepare: {exc}", file=sys.stderr)
        return 1
    seconds = time.monotonic() - started
    megabytes = sum(i.bytes for i in m.inputs) / 1e6
    print(f"paratrain prepare: {args.out}: {m.train.tokens:,} training tokens in {len(m.train.shards)} shard(s), "
          f"{m.val.tokens:,} validation tokens in {len(m.val.shards)}; vocabulary {m.vocab_size} ({m.dtype}); "
          f"{megabytes:.1f} MB in {seconds:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
