#!/usr/bin/env bash
# End to end on a throwaway kind cluster: build both images, install the chart, run a 2-pod CPU gang (gloo) to
# Succeeded, then lose a worker pod mid-training in a second job and see the whole gang restart from its
# checkpoint and succeed. Needs kind, kubectl and helm; Docker is started if none answers (scripts/docker.sh).
#
#   bash scripts/kind-e2e.sh                    # create, test, delete the cluster
#   KEEP_CLUSTER=1 bash scripts/kind-e2e.sh     # leave the cluster up to poke at it afterwards
#   bash scripts/kind-e2e.sh --doc              # run docs/kind.md's bash blocks, in order, as a reader would
#   bash scripts/kind-e2e.sh --print-doc        # print that script (no tools needed)
#
# Env: KIND_CLUSTER_NAME (paratrain-e2e), KIND_NODE_IMAGE (kind-config.yaml's), JOB_TIMEOUT_S (900).
# Namespaces enforce the restricted Pod Security Standard, so the API server itself checks that the operator
# and the trainer pods run non-root, without privilege escalation, with all capabilities dropped.
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER="${KIND_CLUSTER_NAME:-paratrain-e2e}"
OPERATOR_IMAGE="paratrain-operator:e2e"
TRAINER_IMAGE="paratrain-trainer-cpu:e2e"  # the image the jobs in tests/e2e/jobs/ name
OPERATOR_NS="paratrain-system"
JOB_NS="paratrain-e2e"
JOB_TIMEOUT_S="${JOB_TIMEOUT_S:-900}"

log() { printf '\n==> %s\n' "$*"; }
fail() { printf 'kind-e2e: FAILED: %s\n' "$*" >&2; exit 1; }

# docs/kind.md's bash blocks, in order, as one script: the walkthrough cannot drift from what this runs.
doc_script() {
  awk '/^```bash$/ {on = 1; next} /^```$/ {on = 0} on' docs/kind.md
}
if [ "${1:-}" = "--print-doc" ]; then
  doc_script
  exit 0
fi

for tool in kind kubectl helm; do
  command -v "$tool" >/dev/null || { echo "kind-e2e: $tool not found on PATH" >&2; exit 2; }
done
# A Docker daemon that answers: the one running, else one started here (scripts/docker.sh), and stopped again at
# the end only if it was started here.
docker_before="$(bash scripts/docker.sh status)"
bash scripts/docker.sh start
stop_our_docker() {
  [ "$docker_before" != none ] || bash scripts/docker.sh stop
}

if [ "${1:-}" = "--doc" ]; then  # with the reader's kubeconfig and the project's .venv (paratrain export)
  rc=0
  PATH="$PWD/.venv/bin:$PATH" bash -euo pipefail -c "$(doc_script)" || rc=$?
  stop_our_docker
  exit "$rc"
fi

# A kubeconfig of our own: the user's kubeconfig and current context are never touched.
KUBECONFIG="$(mktemp -t paratrain-kind-kubeconfig.XXXXXX)"
export KUBECONFIG

diagnose() {
  echo "---- diagnostics ----" >&2
  kubectl get ptj,pods,svc,pvc -A -o wide >&2 || true
  kubectl -n "$JOB_NS" describe ptj >&2 || true
  kubectl -n "$JOB_NS" get events --sort-by=.lastTimestamp >&2 || true
  kubectl -n "$OPERATOR_NS" logs deployment/paratrain --tail=200 >&2 || true
  for pod in $(kubectl -n "$JOB_NS" get pods -o name 2>/dev/null); do
    echo "---- logs $pod ----" >&2
    kubectl -n "$JOB_NS" logs "$pod" --tail=50 >&2 || true
  done
}

teardown() {
  local rc=$?
  [ "$rc" -eq 0 ] || diagnose
  if [ "${KEEP_CLUSTER:-0}" = 1 ]; then
    echo "kind-e2e: cluster $CLUSTER kept; KUBECONFIG=$KUBECONFIG"
  else
    kind delete cluster --name "$CLUSTER" || true
    rm -f "$KUBECONFIG"
    stop_our_docker
  fi
  exit "$rc"
}
trap teardown EXIT

ptj() {  # ptj JOB JSONPATH: one field of a ParallelTrainJob
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

log "create kind cluster $CLUSTER"
create_args=(--name "$CLUSTER" --config kind-config.yaml --kubeconfig "$KUBECONFIG" --wait 180s)
[ -z "${KIND_NODE_IMAGE:-}" ] || create_args+=(--image "$KIND_NODE_IMAGE")
kind create cluster "${create_args[@]}"

log "build images (operator; CPU trainer)"
docker build -f operator/Dockerfile -t "$OPERATOR_IMAGE" .
docker build -f trainer/Dockerfile.cpu -t "$TRAINER_IMAGE" .
# The operator image must not carry torch: it is the small, API-facing half.
if docker run --rm --entrypoint python "$OPERATOR_IMAGE" -c "import torch" 2>/dev/null; then
  fail "the operator image contains torch"
fi
kind load docker-image --name "$CLUSTER" "$OPERATOR_IMAGE" "$TRAINER_IMAGE"

log "namespaces enforcing the restricted Pod Security Standard"
for ns in "$OPERATOR_NS" "$JOB_NS"; do
  kubectl create namespace "$ns"
  kubectl label namespace "$ns" pod-security.kubernetes.io/enforce=restricted \
    pod-security.kubernetes.io/enforce-version=latest
done

log "install the chart (CRD included)"
helm install paratrain charts/paratrain --namespace "$OPERATOR_NS" \
  --set image.repository=paratrain-operator --set image.tag=e2e --set image.pullPolicy=Never \
  --wait --timeout 180s
kubectl wait crd/paralleltrainjobs.paratrain.dev --for=condition=Established --timeout=60s
kubectl -n "$OPERATOR_NS" rollout status deployment/paratrain --timeout=120s

log "job 1: 2-pod gloo gang to Succeeded"
kubectl -n "$JOB_NS" apply -f tests/e2e/jobs/checkpoints-pvc.yaml
kubectl -n "$JOB_NS" apply -f tests/e2e/jobs/gloo-ddp.yaml
wait_succeeded e2e-gloo-ddp
step="$(ptj e2e-gloo-ddp '{.status.progress.step}')"
total="$(ptj e2e-gloo-ddp '{.status.progress.totalSteps}')"
[ -n "$total" ] && [ "$step" = "$total" ] || fail "e2e-gloo-ddp Succeeded at step '$step' of '$total'"

log "job 2: delete a worker pod mid-training; the gang saves the step in flight, restarts and succeeds"
kubectl -n "$JOB_NS" apply -f tests/e2e/jobs/gloo-restart.yaml
# Past the first checkpoint (interval 50), so the restarted gang has something to resume from.
deadline=$((SECONDS + JOB_TIMEOUT_S))
until [ "$(ptj e2e-gloo-restart '{.status.progress.step}')" -ge 100 ] 2>/dev/null; do
  phase="$(ptj e2e-gloo-restart '{.status.phase}')"
  case "$phase" in Succeeded|Failed) fail "e2e-gloo-restart reached $phase before a worker could be killed" ;; esac
  [ "$SECONDS" -lt "$deadline" ] || fail "e2e-gloo-restart made no progress in ${JOB_TIMEOUT_S}s"
  sleep 3
done
victim="$(kubectl -n "$JOB_NS" get pods \
  -l paratrain.dev/job-name=e2e-gloo-restart,paratrain.dev/node-rank=1 \
  --field-selector=status.phase=Running -o 'jsonpath={.items[0].metadata.name}')"
[ -n "$victim" ] || fail "no running rank-1 pod of e2e-gloo-restart to kill"
echo "deleting worker pod $victim at step $(ptj e2e-gloo-restart '{.status.progress.step}')"
kubectl -n "$JOB_NS" delete pod "$victim" --wait=false
wait_succeeded e2e-gloo-restart
attempt="$(ptj e2e-gloo-restart '{.status.attempt}')"
restarts="$(ptj e2e-gloo-restart '{.status.restarts}')"
# A deleted pod is a stop, not a failure: the gang restarted (attempt 1) without spending backoffLimit.
[ "${attempt:-0}" -ge 1 ] || fail "e2e-gloo-restart Succeeded with attempt='$attempt' (want >= 1)"
[ "${restarts:-0}" -eq 0 ] || fail "e2e-gloo-restart counted the stop as a failure (restarts='$restarts')"
kubectl -n "$JOB_NS" get pods -l paratrain.dev/job-name=e2e-gloo-restart -L paratrain.dev/attempt

log "kind e2e passed"
