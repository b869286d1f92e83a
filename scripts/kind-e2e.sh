#!/usr/bin/env bash
# End to end on a throwaway kind cluster (a control plane and two workers, Kubernetes v1.37.2, every image built
# here). It first runs docs/kind.md as a reader does (its bash blocks, in order, with nothing put on PATH for them:
# tools, both images, the cluster, the chart with two operator replicas, the Shakespeare job stopped and resumed,
# the model exported), then checks on that same cluster what only a real kubelet shows, and last runs the page's
# clean-up block:
#   - the restricted Pod Security Standard refusing a privileged pod; two operator replicas, one holding the Lease;
#   - the page's Shakespeare job, whose pod the page deleted mid-training (SIGTERM, its grace period): Succeeded at
#     its last step with no restart counted, the new gang resumed from the step saved in flight, its checkpoints on
#     a Bound local-path PVC, its pods on workers with exit codes as the runtime reports them and the termination
#     message the operator reads;
#   - a second job: its pods' securityContext as the runtime applied it (uid, no new privileges, no capabilities,
#     seccomp), the downward-API env, the per-gang NetworkPolicy as the CNI enforces it; then the acting operator
#     pod deleted mid-training: the standby takes over and the job succeeds without a restart.
# The page itself exports the job's checkpoint and loads it with transformers.
# One cluster and one `kind load` of the 5.3 GB trainer image serve both halves.
#
#   bash scripts/kind-e2e.sh                    # the page, the checks, then the page's clean-up
#   KEEP_CLUSTER=1 bash scripts/kind-e2e.sh     # leave the cluster up to poke at it afterwards
#   bash scripts/kind-e2e.sh --doc              # docs/kind.md alone, clean-up included
#   bash scripts/kind-e2e.sh --print-doc        # print the page's script (no tools needed)
#
# Docker is started where none answers (scripts/docker.sh) and stopped again at the end if it was started here;
# where none can be started the script exits 3, saying why. Both halves use a kubeconfig of their own (the user's
# ~/.kube/config is never touched). Env: JOB_TIMEOUT_S (900).
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER=paratrain                               # the page's cluster, images and namespaces
OPERATOR_IMAGE=paratrain-operator:dev
TRAINER_IMAGE=ghcr.io/paratrain/trainer-cpu:0.1.0  # the tag the CPU examples and tests/e2e/jobs/ name
OPERATOR_NS=paratrain-system
JOB_NS=ml                                       # the page's job namespace, job, its checkpoint claim, and the
PAGE_JOB=shakespeare                            # step after which it deletes a pod of that job
PAGE_PVC=paratrain-checkpoints
PAGE_STOP_STEP=250
grep -q -- "-ge $PAGE_STOP_STEP ]" docs/kind.md || { echo "kind-e2e: docs/kind.md no longer stops at step $PAGE_STOP_STEP" >&2; exit 1; }
JOB_TIMEOUT_S="${JOB_TIMEOUT_S:-900}"

log() { printf '\n==> %s (%s s)\n' "$*" "$SECONDS"; }
fail() { printf 'kind-e2e: FAILED: %s\n' "$*" >&2; exit 1; }

# docs/kind.md's bash blocks, in order, as one script: the walkthrough cannot drift from what this runs.
# doc_script all | walkthrough (every section before "Clean up") | cleanup (that section on)
doc_script() {
  awk -v want="$1" '/^## / {cleanup = cleanup || /Clean up/}
    /^```bash$/ {on = 1; next} /^```$/ {on = 0}
    on && (want == "all" || (want == "cleanup") == cleanup)' docs/kind.md
}
run_doc() {  # run_doc PART: that part of the page, as a reader runs it (a shell of its own; nothing added to PATH)
  bash -euo pipefail -c "$(doc_script "$1")"
}

mode="${1:-}"
case "$mode" in
  --print-doc) doc_script all; exit 0 ;;
  --doc | "") ;;
  *) echo "usage: $0 [--doc | --print-doc]" >&2; exit 2 ;;
esac

# A Docker daemon that answers: the one running, else one started here (scripts/docker.sh), and stopped again at
# the end only if it was started here.
docker_before="$(bash scripts/docker.sh status)"
if ! bash scripts/docker.sh start; then
  echo "kind-e2e: no Docker daemon answers here and none could be started (scripts/docker.sh start, above)" >&2
  exit 3
fi
# Room on the disk first: a disk that fills while `kind load` copies the trainer image onto the workers fails the
# page half-way, and everything else writing to that disk with it. Measured here with the images built: 30.1 GiB
# at the peak (kind's tar of the 5.3 GB trainer image, then each worker's copy and its unpacked layers); building
# the trainer image takes 5.3 GB more. Docker's data and kind's tar in TMPDIR are counted together (one file system
# here; where they are two, each is asked for the whole, which errs on the safe side).
if docker image inspect "$TRAINER_IMAGE" >/dev/null 2>&1; then
  MIN_FREE_GIB="${KIND_E2E_MIN_FREE_GIB:-32}"
else
  MIN_FREE_GIB="${KIND_E2E_MIN_FREE_GIB:-38}"
fi
free_gib() { df --output=avail -BG "$1" 2>/dev/null | tail -1 | tr -dc '0-9'; }
docker_root="$(docker info -f '{{.DockerRootDir}}' 2>/dev/null || echo /var/lib/docker)"
for where in "$docker_root" "${TMPDIR:-/tmp}"; do
  have="$(free_gib "$where")"
  if [ -n "$have" ] && [ "$have" -lt "$MIN_FREE_GIB" ]; then
    echo "kind-e2e: FAILED: $where has ${have} GiB free; the walkthrough needs about $MIN_FREE_GIB GiB (docs/kind.md," \
      "Sizing): free some (docker image prune; old kind clusters: kind get clusters) or set KIND_E2E_MIN_FREE_GIB" >&2
    [ "$docker_before" != none ] || bash scripts/docker.sh stop
    exit 1
  fi
done
KUBECONFIG="$(mktemp -t paratrain-kind-kubeconfig.XXXXXX)"
export KUBECONFIG
WORK="$(mktemp -d -t paratrain-kind-e2e.XXXXXX)"

diagnose() {
  echo "---- diagnostics ----" >&2
  kubectl get nodes -o wide >&2 || true
  kubectl get ptj,pods,svc,pvc,lease -A -o wide >&2 || true
  kubectl describe ptj -A >&2 || true
  kubectl -n "$JOB_NS" describe pods >&2 || true
  kubectl get events -A --sort-by=.lastTimestamp >&2 || true
  kubectl -n "$OPERATOR_NS" logs -l app.kubernetes.io/name=paratrain --tail=100 --prefix >&2 || true
  for pod in $(kubectl get pods -A -l paratrain.dev/job-name -o 'jsonpath={range .items[*]}{.metadata.namespace}/{.metadata.name} {end}' 2>/dev/null); do
    echo "---- logs $pod ----" >&2
    kubectl -n "${pod%/*}" logs "${pod#*/}" --tail=50 >&2 || true
  done
}

teardown() {
  local rc=$? kind_bin
  kind_bin="$(bash scripts/kindbin.sh --path 2>/dev/null || true)"
  [ -z "$kind_bin" ] || PATH="$kind_bin:$PATH"
  [ "$rc" -eq 0 ] || [ -z "$kind_bin" ] || diagnose
  if [ "${KEEP_CLUSTER:-0}" = 1 ]; then
    echo "kind-e2e: cluster $CLUSTER kept; KUBECONFIG=$KUBECONFIG"
  else
    [ -z "$kind_bin" ] || run_doc cleanup || kind delete cluster --name "$CLUSTER" || true
    rm -rf "$KUBECONFIG" "$WORK"
    [ "$docker_before" != none ] || bash scripts/docker.sh stop
  fi
  exit "$rc"
}
trap teardown EXIT

if [ "$mode" = --doc ]; then
  log "docs/kind.md, as a reader runs it"
  run_doc walkthrough
  log "docs/kind.md passed"
  exit 0
fi

log "docs/kind.md up to its clean-up, as a reader runs it"
run_doc walkthrough
PATH="$(bash scripts/kindbin.sh):$PATH"  # the same tools the page built (cached)

ptj() {  # ptj JOB JSONPATH: one field of a ParallelTrainJob in the page's job namespace
  kubectl -n "$JOB_NS" get "ptj/$1" -o "jsonpath=$2"
}

wait_succeeded() {  # wait_succeeded JOB: until phase Succeeded; fails at once on Failed, or after JOB_TIMEOUT_S
  local job=$1 deadline=$((SECONDS + JOB_TIMEOUT_S))
  until kubectl -n "$JOB_NS" wait "ptj/$job" --for=jsonpath='{.status.phase}'=Succeeded --timeout=20s >/dev/null 2>&1; do
    kubectl -n "$JOB_NS" get "ptj/$job" --no-headers || true
    if [ "$(ptj "$job" '{.status.phase}')" = Failed ]; then
      fail "$job is Failed: $(ptj "$job" '{.status.failure}')"
    fi
    [ "$SECONDS" -lt "$deadline" ] || fail "$job not Succeeded after ${JOB_TIMEOUT_S}s"
  done
  kubectl -n "$JOB_NS" get "ptj/$job"
}

wait_step() {  # wait_step JOB STEP: until the job's reported step reaches STEP
  local job=$1 want=$2 deadline=$((SECONDS + JOB_TIMEOUT_S)) phase
  until [ "$(ptj "$job" '{.status.progress.step}')" -ge "$want" ] 2>/dev/null; do
    phase="$(ptj "$job" '{.status.phase}')"
    case "$phase" in Succeeded|Failed) fail "$job reached $phase before step $want" ;; esac
    [ "$SECONDS" -lt "$deadline" ] || fail "$job did not reach step $want in ${JOB_TIMEOUT_S}s"
    sleep 3
  done
}

running_pod() {  # running_pod JOB NODE_RANK: the name of that running pod of the job
  kubectl -n "$JOB_NS" get pods -l "paratrain.dev/job-name=$1,paratrain.dev/node-rank=$2" \
    --field-selector=status.phase=Running -o 'jsonpath={.items[0].metadata.name}'
}

log "the page's cluster and images"
[ "$(kubectl get nodes --no-headers | wc -l)" -eq 3 ] || fail "want 3 nodes (kind-config.yaml)"
kubectl wait nodes --all --for=condition=Ready --timeout=120s
# The operator image must not carry torch: it is the small, API-facing half.
if docker run --rm --entrypoint python "$OPERATOR_IMAGE" -c "import torch" 2>/dev/null; then
  fail "the operator image contains torch"
fi

log "the page's namespaces enforce the restricted Pod Security Standard"
for ns in "$OPERATOR_NS" "$JOB_NS"; do
  [ "$(kubectl get namespace "$ns" -o 'jsonpath={.metadata.labels.pod-security\.kubernetes\.io/enforce}')" \
    = restricted ] || fail "the page's namespace $ns does not enforce the restricted profile"
done
# The admission plugin itself refuses a pod that breaks the profile.
if out="$(kubectl -n "$JOB_NS" run privileged --image="$TRAINER_IMAGE" --restart=Never \
  --overrides='{"spec": {"containers": [{"name": "privileged", "image": "'"$TRAINER_IMAGE"'",
  "securityContext": {"privileged": true}}]}}' 2>&1)"; then
  fail "a privileged pod was admitted into a restricted namespace"
fi
grep -q 'violates PodSecurity "restricted' <<<"$out" || fail "unexpected refusal: $out"

log "the page's chart: two operator replicas, one holding the Lease"
kubectl -n "$OPERATOR_NS" rollout status deployment/paratrain --timeout=180s
[ "$(kubectl -n "$OPERATOR_NS" get deployment paratrain -o 'jsonpath={.status.readyReplicas}')" = 2 ] \
  || fail "want two ready operator replicas"
leader() { kubectl -n "$OPERATOR_NS" get lease -o 'jsonpath={.items[0].spec.holderIdentity}'; }
deadline=$((SECONDS + 120))
until [ -n "$(leader)" ]; do [ "$SECONDS" -lt "$deadline" ] || fail "no operator replica took the lease"; sleep 2; done
echo "acting operator: $(leader)"

log "the page's job: stopped at step >= $PAGE_STOP_STEP, resumed, Succeeded; its pods as the runtime left them"
[ "$(ptj "$PAGE_JOB" '{.status.phase}')" = Succeeded ] || fail "$PAGE_JOB is not Succeeded"
step="$(ptj "$PAGE_JOB" '{.status.progress.step}')"
total="$(ptj "$PAGE_JOB" '{.status.progress.totalSteps}')"
[ -n "$total" ] && [ "$step" = "$total" ] || fail "$PAGE_JOB Succeeded at step '$step' of '$total'"
attempt="$(ptj "$PAGE_JOB" '{.status.attempt}')"
restarts="$(ptj "$PAGE_JOB" '{.status.restarts}')"
[ "${attempt:-0}" -ge 1 ] || fail "$PAGE_JOB never restarted its gang after the pod delete (attempt '$attempt')"
[ "${restarts:-0}" -eq 0 ] || fail "$PAGE_JOB counted the stop as a failure (restarts='$restarts')"
kubectl -n "$JOB_NS" get pods -l "paratrain.dev/job-name=$PAGE_JOB" -L paratrain.dev/attempt -o wide
# The new gang resumed from the step the stopped one saved in flight, not from the periodic checkpoint before it
# (interval 200 < the step at the delete).
resumed="$(kubectl -n "$JOB_NS" logs "$PAGE_JOB-$attempt-0" | grep -m1 -oE 'resume step=[0-9]+' || true)"
echo "new gang: ${resumed:-no resume}"
[ -n "$resumed" ] && [ "${resumed#resume step=}" -ge "$PAGE_STOP_STEP" ] \
  || fail "the restarted gang did not resume from the step in flight (${resumed:-none}; stopped at >= $PAGE_STOP_STEP)"
# Rank 0's final progress, read by the operator from its termination message.
message="$(kubectl -n "$JOB_NS" get pod "$PAGE_JOB-$attempt-0" \
  -o 'jsonpath={.status.containerStatuses[0].state.terminated.message}')"
grep -q '"step"' <<<"$message" || fail "rank 0's termination message holds no progress: '$message'"
[ "$(kubectl -n "$JOB_NS" get pvc "$PAGE_PVC" -o 'jsonpath={.status.phase}')" = Bound ] || fail "PVC not Bound"
for p in $(kubectl -n "$JOB_NS" get pods -l "paratrain.dev/job-name=$PAGE_JOB,paratrain.dev/attempt=$attempt" -o name); do
  node="$(kubectl -n "$JOB_NS" get "$p" -o 'jsonpath={.spec.nodeName}')"
  case "$node" in "$CLUSTER"-worker*) ;; *) fail "$p ran on $node, not a worker" ;; esac
  code="$(kubectl -n "$JOB_NS" get "$p" -o 'jsonpath={.status.containerStatuses[0].state.terminated.exitCode}')"
  [ "$code" = 0 ] || fail "$p exited with '$code' (want 0, as the runtime reports it)"
done

log "a second job: its pods as the runtime runs them, then the acting operator pod deleted mid-training"
kubectl -n "$JOB_NS" apply -f tests/e2e/jobs/gloo-failover.yaml
wait_step e2e-gloo-failover 20
pod="$(running_pod e2e-gloo-failover 1)"
[ -n "$pod" ] || fail "no running rank-1 pod of e2e-gloo-failover"
# The securityContext as the container runtime applied it, and the downward-API env.
# shellcheck disable=SC2016  # expanded in the pod
status="$(kubectl -n "$JOB_NS" exec "$pod" -- sh -c 'id -u; grep -E "^(NoNewPrivs|CapEff|Seccomp):" /proc/1/status;
  printf "%s %s\n" "$POD_NAME" "$POD_IP"')"
echo "$status"
[ "$(sed -n 1p <<<"$status")" != 0 ] || fail "the trainer runs as root"
grep -qE '^NoNewPrivs:\s+1$' <<<"$status" || fail "privilege escalation is not blocked"
grep -qE '^CapEff:\s+0+$' <<<"$status" || fail "the trainer holds capabilities"
grep -qE '^Seccomp:\s+2$' <<<"$status" || fail "no seccomp filter (RuntimeDefault)"
pod_ip="$(kubectl -n "$JOB_NS" get pod "$pod" -o 'jsonpath={.status.podIP}')"
grep -qx "$pod $pod_ip" <<<"$status" || fail "downward-API env: want '$pod $pod_ip'"
# The gang's NetworkPolicy as the CNI enforces it (kube-network-policies): a gang pod reaches rank 0's rendezvous
# port, a pod outside the gang in the same namespace does not. kube-network-policies judges packets through
# nf_tables' queue expression; a kernel without it (nft_queue) cannot enforce NetworkPolicy this way.
# shellcheck disable=SC2016  # expanded in the node
queue_probe='nft add table inet paratrain_probe && nft add chain inet paratrain_probe c &&
  nft add rule inet paratrain_probe c queue num 1 bypass; rc=$?; nft delete table inet paratrain_probe; exit $rc'
if docker exec "$CLUSTER-worker" sh -c "$queue_probe" >/dev/null 2>&1; then
  rank0_ip="$(kubectl -n "$JOB_NS" get pod "$(running_pod e2e-gloo-failover 0)" -o 'jsonpath={.status.podIP}')"
  # connect_ex: 0 when connected, ECONNREFUSED when nothing listens, a timeout when a policy drops the packets
  connect="import socket, sys; s = socket.socket(); s.settimeout(5); print(s.connect_ex((sys.argv[1], 29500)))"
  gang_sees() { kubectl -n "$JOB_NS" exec "$pod" -- python -c "$connect" "$rank0_ip"; }
  [ "$(gang_sees)" = 0 ] || fail "a gang pod cannot reach rank 0's rendezvous port"
  outsider="$(kubectl -n "$JOB_NS" run outsider --image="$TRAINER_IMAGE" --restart=Never --rm -i --quiet --overrides='{"spec":
    {"securityContext": {"runAsNonRoot": true, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
    "containers": [{"name": "outsider", "image": "'"$TRAINER_IMAGE"'", "stdin": true,
    "command": ["python", "-c", "'"$connect"'", "'"$rank0_ip"'"],
    "securityContext": {"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}}}]}}')"
  [ "$outsider" != 0 ] || fail "a pod outside the gang reached rank 0's rendezvous port (NetworkPolicy not enforced)"
  [ "$(gang_sees)" = 0 ] || fail "rank 0's rendezvous port closed while the outsider probed it"
  echo "NetworkPolicy holds (outsider: errno $outsider): the gang reaches $rank0_ip:29500, an outsider does not"
else
  echo "NetworkPolicy NOT checked: this kernel's nf_tables has no queue expression (nft_queue), which" \
    "kube-network-policies needs to enforce it; the gang's policy is in place but unenforced here"
fi
old_leader="$(leader)"
echo "deleting the acting operator pod at step $(ptj e2e-gloo-failover '{.status.progress.step}')"
kubectl -n "$OPERATOR_NS" delete pod "${old_leader%_*}" --wait=false  # the identity is <pod name>_<random>
deadline=$((SECONDS + 180))
until [ -n "$(leader)" ] && [ "$(leader)" != "$old_leader" ]; do
  [ "$SECONDS" -lt "$deadline" ] || fail "no standby took the lease from $old_leader"
  sleep 2
done
echo "acting operator now: $(leader)"
wait_succeeded e2e-gloo-failover
[ "$(ptj e2e-gloo-failover '{.status.attempt}')" -eq 0 ] || fail "the failover restarted e2e-gloo-failover's gang"
[ "$(ptj e2e-gloo-failover '{.status.progress.step}')" = "$(ptj e2e-gloo-failover '{.status.progress.totalSteps}')" ] \
  || fail "e2e-gloo-failover Succeeded short of its last step"

log "kind e2e passed"
