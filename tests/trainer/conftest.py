import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch.distributed as dist

from .harness import forced_cpu_fp16_env, layout, run_job


@pytest.fixture(scope="session")
def one_rank_group():
    """A real one-process gloo group, for the collective calls of code tested inside the test process. One per
    session: DeepSpeed caches the groups it sees, so a second default group would confuse it."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@dataclass(frozen=True)
class CpuFp16:
    """A CPU's answer to "native fp16?", forced for one test: in the test process, and in the jobs it runs with
    `env`."""

    native: bool

    @property
    def env(self) -> dict[str, str]:
        return forced_cpu_fp16_env(self.native)


@pytest.fixture(params=[True, False], ids=["native-fp16", "no-native-fp16"])
def cpu_fp16(request, monkeypatch) -> CpuFp16:
    """Both branches of a test whose outcome depends on the CPU's native fp16 (AVX512-FP16/AMX-FP16: Intel Sapphire
    Rapids and newer have it, AMD's Zen 4 EPYCs do not), on every CPU, whatever this one has: the suite must not
    prove only the branch of the machine it happens to run on. `indirect` parametrization picks one branch."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    from paratrain.train.parallel import precision

    monkeypatch.setattr(precision, "cpu_has_native_fp16", lambda: request.param)
    monkeypatch.setattr(CPU_Accelerator, "is_fp16_supported", lambda self: request.param)
    return CpuFp16(request.param)


@pytest.fixture(scope="session")
def job_runs(tmp_path_factory):
    """Jobs shared across test modules, each run once per session: `job_runs(name, overrides, env=..., spec=...)`
    → (run_dir, metrics). Runs are keyed by what they run, not by `name` (which only names the directory), so two
    modules asking for the same layout share one run. "{run_dir}" in an override or an environment value is the
    job's own directory."""
    done: dict[str, tuple[Path, dict]] = {}

    def get(name: str, overrides: list[str], env: dict | None = None, spec: dict | None = None):
        key = json.dumps([overrides, env, spec], sort_keys=True)
        if key not in done:
            run_dir = tmp_path_factory.mktemp(name)
            _, metrics = run_job(run_dir, [o.format(run_dir=run_dir) for o in overrides], job=spec,
                                 env={k: v.format(run_dir=run_dir) for k, v in (env or {}).items()})
            done[key] = run_dir, metrics
        return done[key]

    return get


@pytest.fixture(scope="session")
def reference(job_runs):
    """The single-process fp32 run of the parity job that every layout is compared with."""
    return job_runs("reference", layout())[1]


SHAKESPEARE = Path(__file__).resolve().parents[2] / "examples" / "data" / "tinyshakespeare.txt"
DOCS = [json.dumps({"text": t}) for t in ("First document.", "Second,\r\nwith a CRLF and ü.", "")]


@pytest.fixture(scope="session")
def token_inputs(tmp_path_factory) -> list[Path]:
    """A text file (the first 150 kB of Shakespeare) and a JSONL file of three documents."""
    root = tmp_path_factory.mktemp("token-inputs")
    text, docs = root / "shakespeare.txt", root / "docs.jsonl"
    text.write_bytes(SHAKESPEARE.read_bytes()[:150_000])
    docs.write_text("\n".join(DOCS) + "\n")
    return [text, docs]


@pytest.fixture(scope="session")
def token_dir(tmp_path_factory, token_inputs) -> Path:
    """`paratrain prepare --train-bpe 512 --shard-tokens 20000` of token_inputs (about 75k tokens, 4 shards)."""
    from paratrain.prepare import prepare

    out = tmp_path_factory.mktemp("tokens") / "shakespeare-bpe"
    prepare(out, token_inputs, bpe_vocab=512, shard_tokens=20_000)
    return out
