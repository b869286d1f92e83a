"""torchrun's env contract, shared by the operator's renderer (pods) and the local launcher (processes).

A pod gets the *node* env: torchrun reads `PET_*` variables as defaults for its flags, so the pod command
(`paratrain node`, torchrun with exit codes passed through) needs no flags. torchrun gives each worker the *worker* env
(RANK, LOCAL_RANK, WORLD_SIZE, ...). The local launcher skips torchrun and gives each process the worker env
directly, so a trainer process cannot tell a laptop from a cluster.
"""

from __future__ import annotations

SPEC_MOUNT_DIR = "/etc/paratrain"
SPEC_FILE_NAME = "job.yaml"
SPEC_PATH_IN_POD = f"{SPEC_MOUNT_DIR}/{SPEC_FILE_NAME}"
MASTER_PORT = 29500
PROGRESS_PORT = 29400

# The trainer's env besides torchrun's worker env.
ENV_JOB_NAME = "PARATRAIN_JOB_NAME"
# The pod's gang attempt (as in its name; bumped by restarts and resumes): for the user's code and logs, since
# the trainer itself does not read it.
ENV_RESTART_ATTEMPT = "PARATRAIN_RESTART_ATTEMPT"
ENV_PROGRESS_PORT = "PARATRAIN_PROGRESS_PORT"  # rank 0 serves GET /progress here when set
ENV_PROGRESS_HOST = "POD_IP"  # where the progress server binds (the downward API's status.podIP in pods)
ENV_EVENTS_FILE = "PARATRAIN_EVENTS_FILE"  # rank 0 appends one JSON line per event (local launcher reads it)
ENV_METRICS_OUT = "PARATRAIN_METRICS_OUT"  # rank 0 writes the run's metrics JSON here at the end
ENV_MEASURE_MEMORY = "PARATRAIN_MEASURE_MEMORY"  # "1": measure live tensor bytes on CPU too (MemTracker, slow)
ENV_PEAK_FLOPS = "PARATRAIN_PEAK_FLOPS"  # one device's peak FLOP/s, for MFU where the trainer cannot look it up
ENV_DEVICE = "PARATRAIN_DEVICE"  # "cpu" forces CPU/gloo even where CUDA is present or gpusPerNode > 0
# Rank 0 writes its final progress JSON here: the pod's termination message, which the operator reads after
# the pod exits (the progress endpoint is gone by then). Kubernetes' default terminationMessagePath:
# After this many steps of an attempt, rank 0 reports the largest rank's peak of device memory (a GPU's) and
# the operator writes the measurements beside status.plan's predictions.
MEASURE_AFTER_STEPS = 10
ENV_TERMINATION_LOG = "PARATRAIN_TERMINATION_LOG"
# Seconds `paratrain node` gives its workers to save and exit after a SIGTERM (the pod's grace period, less a margin).
ENV_STOP_GRACE = "PARATRAIN_STOP_GRACE_SECONDS"
STOP_MARGIN_SECONDS = 5  # of the grace period, what `paratrain node` keeps for itself after its workers exit
TERMINATION_LOG_PATH = "/dev/termination-log"
# The job's exit-code rules (spec.failurePolicy.rules with exitCodes, as JSON): which worker exits `paratrain node`
# restarts in place.
ENV_EXIT_CODE_RULES = "PARATRAIN_EXIT_CODE_RULES"
# Set by `paratrain node` for the workers of an in-place restart: why this node's last round ended, as JSON
# {"rank", "nodeRank", "exitCode"}; rank 0 reports the gang's root cause to the operator.
ENV_LAST_FAILURE = "PARATRAIN_LAST_FAILURE"
# restartPolicy.hangSeconds, for `paratrain node`'s agent; and the directory where its workers write their
# heartbeats (paratrain.rounds), which the agent makes: a program of its own may beat there too.
ENV_HANG_SECONDS = "PARATRAIN_HANG_SECONDS"
ENV_HEARTBEAT_DIR = "PARATRAIN_HEARTBEAT_DIR"

# The job's layout, in every process's env: what a program of its own (spec.entrypoint) reads to build its mesh.
ENV_LAYOUT_DATA = "PARATRAIN_DATA"
ENV_LAYOUT_TENSOR = "PARATRAIN_TENSOR"
ENV_LAYOUT_PIPELINE = "PARATRAIN_PIPELINE"
ENV_LAYOUT_ZERO_STAGE = "PARATRAIN_ZERO_STAGE"
ENV_LAYOUT_PRECISION = "PARATRAIN_PRECISION"

# Labels on every object of a job's gang (the operator selects by them).
LABEL_JOB = "paratrain.dev/job-name"
LABEL_ATTEMPT = "paratrain.dev/attempt"
LABEL_NODE_RANK = "paratrain.dev/node-rank"
# An elastic gang's placeholder pods (their rank, for the size they would grow the gang to): they hold no rank and
# run nothing, and say by being placed that capacity for more pods has returned.
LABEL_PROBE = "paratrain.dev/probe-rank"
PROBE_COMMAND = ["sleep", "infinity"]

# How NCCL fails, for pods (the operator sets these) and local runs (the trainer sets them where unset): a broken gang
# must fail fast, with the error in Python, rather than hang on a collective or die without saying why.
COMMS_ENV = {
    # A failed or timed-out collective aborts the rank's communicators (their kernels end, so nothing stays blocked)
    # but not the process (2, CleanUpOnly; 1 and torch's default 3 end it with SIGABRT): the next collective, or
    # the step's check of its process groups (train.nccl_errors), raises DistBackendError in Python, so the rank
    # exits 75 and a timeout gets the roll call that names the hung rank. (Blocking wait, TORCH_NCCL_BLOCKING_WAIT,
    # is left off: the watchdog enforces runPolicy.collectiveTimeoutSeconds without a busy wait per call.)
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    # The rank that meets the error tells the other ranks of that group through the store, and their watchdogs
    # abort too: they fail in seconds, not at their own collective timeout.
    "TORCH_NCCL_PROPAGATE_ERROR": "1",
    # The watchdog's heartbeat monitor kills a rank whose watchdog itself is stuck (e.g. in a CUDA call): SIGABRT,
    # still classified (EXIT_ABORTED).
    "TORCH_NCCL_ENABLE_MONITORING": "1",
    # Flight recorder: on a timeout each rank dumps its last collectives to /tmp, to tell which rank hung. (Its old
    # name, TORCH_NCCL_TRACE_BUFFER_SIZE, made torch 2.13 log a deprecation warning in every pod, CPU ones too.)
    "TORCH_FR_BUFFER_SIZE": "2000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    # NCCL's warnings and errors, without INFO's per-ring lines from every rank.
    "NCCL_DEBUG": "WARN",
}

# Exit codes the trainer uses so the operator can classify failures without reading logs.
EXIT_OK = 0
EXIT_INVALID_SPEC = 2  # permanent: the spec can never train
EXIT_RETRYABLE = 75  # EX_TEMPFAIL: a peer vanished, a collective timed out; a gang restart may succeed
# SIGABRT's exit (128 + 6): NCCL's heartbeat monitor ends a rank whose watchdog is stuck, and the watchdog itself ends a
# rank whose collective failed or timed out where the user set TORCH_NCCL_ASYNC_ERROR_HANDLING to 1 or 3 (most often
# because a peer died): like 75, a consequence where another pod's failure is known.
EXIT_ABORTED = 134
# Exits that say another rank's failure ended this one (a peer died; the watchdog aborted a rank whose peer died).
CONSEQUENCE_EXITS = frozenset({EXIT_RETRYABLE, EXIT_ABORTED})
# Stopped on request (SIGTERM: a drain, a preemption, a suspend), a checkpoint of the last whole step written: the
# operator restarts the gang without counting it against backoffLimit.
EXIT_PREEMPTED = 76
# Out of device memory, building the model (its shards, its optimizer state) or in a step: the layout does not fit
# the device at this batch, and a restart would only meet the same error (EX_CONFIG, a configuration error).
# Permanent unless a spec.failurePolicy rule says otherwise (a memory leak a restart clears, fragmentation).
EXIT_OUT_OF_MEMORY = 78
# A rank that made no progress for restartPolicy.hangSeconds while alive, stopped by its agent (paratrain.rounds):
# restarted like any failure; its peers' 75s are the consequence.
EXIT_HUNG = 79
# 126/127: the image cannot run the command.
PERMANENT_EXIT_CODES = frozenset({EXIT_INVALID_SPEC, EXIT_OUT_OF_MEMORY, 126, 127})
# The permanent codes whose pod's termination message carries the trainer's own words ({"error": ...}).
EXPLAINED_EXIT_CODES = frozenset({EXIT_INVALID_SPEC, EXIT_OUT_OF_MEMORY})


def service_name(job_name: str) -> str:
    """The headless Service giving every pod of the job a DNS name."""
    return job_name


def pod_hostname(job_name: str, node_rank: int) -> str:
    """Stable across gang restarts, so rank 0's DNS name (the rendezvous address) never changes."""
    return f"{job_name}-{node_rank}"


def pod_name(job_name: str, attempt: int, node_rank: int) -> str:
    """Unique per gang attempt: a restarted gang never collides with, or is mistaken for, the old one."""
    return f"{job_name}-{attempt}-{node_rank}"


def probe_name(job_name: str, attempt: int, node_rank: int) -> str:
    """An elastic gang's placeholder for node rank `node_rank` of a larger gang, in attempt `attempt`."""
    return f"{job_name}-{attempt}-probe-{node_rank}"


def pod_dns_name(job_name: str, namespace: str, node_rank: int) -> str:
    """`<hostname>.<service>.<namespace>.svc`: resolvable once the pod exists (publishNotReadyAddresses)."""
    return f"{pod_hostname(job_name, node_rank)}.{service_name(job_name)}.{namespace}.svc"


def node_env(*, nnodes: int, nproc_per_node: int, node_rank: int, master_addr: str,
             master_port: int = MASTER_PORT, rendezvous_timeout: int | None = None,
             in_place_limit: int = 0) -> dict[str, str]:
    """What a pod gets: torchrun's PET_* flags (static rendezvous on rank 0's stable DNS name); torchrun waits
    `rendezvous_timeout` seconds for its peers (its own default: 600) and restarts its workers in place up to
    `in_place_limit` times (spec.restartPolicy.inPlaceLimit; after that, restarts are the operator's, for the whole
    gang)."""
    timeout = {"PET_RDZV_CONF": f"timeout={rendezvous_timeout}"} if rendezvous_timeout else {}
    return {**timeout,
        "PET_NNODES": str(nnodes),
        "PET_NPROC_PER_NODE": str(nproc_per_node),
        "PET_NODE_RANK": str(node_rank),
        "PET_MASTER_ADDR": master_addr,
        "PET_MASTER_PORT": str(master_port),
        "PET_MAX_RESTARTS": str(in_place_limit),
    }


def worker_env(*, rank: int, nnodes: int, nproc_per_node: int, master_addr: str, master_port: int) -> dict[str, str]:
    """What torchrun gives each worker process; the local launcher sets exactly this."""
    node_rank, local_rank = divmod(rank, nproc_per_node)
    world = nnodes * nproc_per_node
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "GROUP_RANK": str(node_rank),
        "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(nproc_per_node),
        "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        # torchrun's static rendezvous: its agent on node 0 hosts the TCPStore at MASTER_PORT, every rank is a client.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


def layout_env(parallelism, precision: str) -> dict[str, str]:
    """A spec's layout (its `parallelism` section and `precision`) as the env every process gets."""
    p = parallelism
    return {ENV_LAYOUT_DATA: str(p.data), ENV_LAYOUT_TENSOR: str(p.tensor), ENV_LAYOUT_PIPELINE: str(p.pipeline),
            ENV_LAYOUT_ZERO_STAGE: str(p.zero_stage), ENV_LAYOUT_PRECISION: precision}


def train_command() -> list[str]:
    """The pod's container command: `paratrain node`, torchrun (flags from PET_*) starting `paratrain train` per GPU
    with the workers' exit codes passed through (see paratrain.node)."""
    return ["paratrain", "node", "--spec", SPEC_PATH_IN_POD]
