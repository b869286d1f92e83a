#!/usr/bin/env bash
# A real Kubernetes control plane on loopback, for tests and for trying the operator without a cluster:
# etcd, kube-apiserver (secure port, x509 client certs, RBAC), kube-controller-manager (garbage collector,
# namespace, service-account, ClusterRole aggregation and resource-quota controllers: a ResourceQuota holds as on
# a real cluster) and kube-scheduler, built from pinned
# sources by scripts/testbin.sh.
#
#   scripts/test-cluster.sh up DIR [--nodes N]   start it; writes DIR/kubeconfig (admin), exits 0 once /readyz is ok
#   scripts/test-cluster.sh down DIR             stop every process `up` started in DIR
#   scripts/test-cluster.sh env DIR              print the shell variables of a running one (KUBECONFIG, PATH, ...)
#
# Without --nodes no kubelet runs: nodes are registered by whoever runs pods (the tests' kubelet,
# tests/operator/support/). With --nodes N, N try-out nodes are registered and served by that test kubelet
# (tests/operator/support/nodes.py, in this checkout's .venv): pods run as local processes in the repository
# (no images, no isolation), and each PersistentVolumeClaim is bound to a directory under DIR/nodes/pvc. A try-out
# cluster, not a production one.
# DIR also holds: pki/ (CA, serving and client certificates, the service-account signing key), one log per
# component (DIR/logs/), pids, ports, and etcd's data (or a link to it in /dev/shm: store_dir below). Gang
# scheduling is on: the GenericWorkload feature gate and the scheduling.k8s.io/v1beta1 API (Workload, PodGroup).
set -euo pipefail

usage() { echo "usage: $0 up DIR [--nodes N] | down DIR | env DIR" >&2; exit 2; }
[[ $# -eq 2 || ( $# -eq 4 && "$1" == up && "$3" == --nodes ) ]] || usage
cmd="$1"
NODES="${4:-0}"
[[ "$NODES" =~ ^[0-9]+$ ]] || usage
mkdir -p "$2"
DIR="$(cd "$2" && pwd)"
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
# Kubernetes' own gang scheduling (beta) and its topology constraint for a gang (alpha in 1.37).
FEATURE_GATES="GenericWorkload=true,TopologyAwareWorkloadScheduling=true"
READY_TIMEOUT="${PARATRAIN_TEST_CLUSTER_TIMEOUT:-120}"

stop_all() {
  [[ -f "$DIR/pids" ]] || return 0
  local pid
  # Reverse start order: the scheduler and controller-manager first, etcd last.
  for pid in $(tac "$DIR/pids"); do kill "$pid" 2>/dev/null || true; done
  for _ in $(seq 50); do
    local alive=0
    for pid in $(cat "$DIR/pids"); do kill -0 "$pid" 2>/dev/null && alive=1; done
    [[ $alive == 0 ]] && break
    sleep 0.1
  done
  for pid in $(cat "$DIR/pids"); do kill -9 "$pid" 2>/dev/null || true; done
  rm -f "$DIR/pids"
}

# etcd's data in memory (/dev/shm, where it has room): a store on the disk stalls, and fails once the disk is
# full, whenever something else on the machine fills or floods that disk (seen: a kind e2e beside the live tests
# loading a 5 GB image onto its nodes). DIR/etcd is then a link to it, removed with it.
ETCD_MEMORY_MIN_KIB=$((4 * 1024 * 1024))
store_dir() {
  sweep_stale_stores
  if [[ -d /dev/shm && -w /dev/shm ]] && \
     (( $(df --output=avail -k /dev/shm 2>/dev/null | tail -1 || echo 0) >= ETCD_MEMORY_MIN_KIB )); then
    ln -s "$(mktemp -d /dev/shm/paratrain-etcd.XXXXXX)" "$DIR/etcd"
  fi
}
# Stores that a killed run left in memory: older than 10 minutes (not one being started beside this one) with no
# file open by any process (a live etcd holds its WAL and db open). No pipe into `grep -q` here: under pipefail
# the SIGPIPE it sends find on a match fails the pipeline, and a live store was deleted so.
sweep_stale_stores() {
  local store
  for store in $(find /dev/shm -maxdepth 1 -name 'paratrain-etcd.*' -user "$(id -u)" -mmin +10 2>/dev/null); do
    if [[ -z "$(find /proc/[0-9]*/fd -maxdepth 1 -lname "$store/*" -print -quit 2>/dev/null)" ]]; then
      rm -rf "$store"
    fi
  done
}
remove_store() {
  if [[ -L "$DIR/etcd" ]]; then
    rm -rf "$(readlink "$DIR/etcd")"
  fi
  rm -rf "$DIR/etcd"
}

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# One certificate signed by the cluster CA: NAME, subject, optional subjectAltName.
issue_cert() {
  local name="$1" subject="$2" san="${3:-}"
  openssl req -new -newkey rsa:2048 -nodes -keyout "$PKI/$name.key" -subj "$subject" -out "$PKI/$name.csr" \
    2>/dev/null
  local ext="$PKI/$name.ext"
  {
    echo "basicConstraints=CA:FALSE"
    echo "keyUsage=digitalSignature,keyEncipherment"
    if [[ -n "$san" ]]; then
      echo "extendedKeyUsage=serverAuth"
      echo "subjectAltName=$san"
    else
      echo "extendedKeyUsage=clientAuth"
    fi
  } > "$ext"
  openssl x509 -req -in "$PKI/$name.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial -days 30 \
    -extfile "$ext" -out "$PKI/$name.crt" 2>/dev/null
  rm -f "$PKI/$name.csr" "$ext"
}

make_pki() {
  PKI="$DIR/pki"
  mkdir -p "$PKI"
  [[ -f "$PKI/ca.crt" ]] && return 0
  openssl req -x509 -new -newkey rsa:2048 -nodes -keyout "$PKI/ca.key" -subj "/CN=paratrain-test-ca" -days 30 \
    -out "$PKI/ca.crt" 2>/dev/null
  issue_cert apiserver "/CN=kube-apiserver" \
    "IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc"
  # Identities RBAC knows: system:masters is the admin group; the two components have bootstrap ClusterRoles.
  issue_cert admin "/O=system:masters/CN=paratrain-test-admin"
  issue_cert controller-manager "/CN=system:kube-controller-manager"
  issue_cert scheduler "/CN=system:kube-scheduler"
  openssl genrsa -out "$PKI/sa.key" 2048 2>/dev/null
  openssl rsa -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub" 2>/dev/null
}

# A kubeconfig for one identity, with embedded paths (FILE, certificate name).
write_kubeconfig() {
  local file="$1" who="$2"
  cat > "$file" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: test
  cluster: {server: "https://127.0.0.1:$API_PORT", certificate-authority: "$PKI/ca.crt"}
users:
- name: $who
  user: {client-certificate: "$PKI/$who.crt", client-key: "$PKI/$who.key"}
contexts:
- name: test
  context: {cluster: test, user: $who, namespace: default}
current-context: test
EOF
}

start() {  # NAME ARGS...: a component in its own session, so it outlives this script
  local name="$1"
  shift
  setsid "$@" > "$DIR/logs/$name.log" 2>&1 < /dev/null &
  echo $! >> "$DIR/pids"
}

await_component() {  # NAME PID TENTHS CHECK...: until CHECK succeeds, while NAME's process lives, TENTHS x 0.1 s at most
  local name="$1" pid="$2" tenths="$3" waited=0
  shift 3
  until "$@" 2>/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null || (( waited >= tenths )); then
      echo "test-cluster: $name did not come up; its log ($DIR/logs/$name.log) ends:" >&2
      tail -20 "$DIR/logs/$name.log" >&2
      return 1
    fi
    sleep 0.1
    waited=$((waited + 1))
  done
}

readyz() {
  curl -sf --max-time 2 --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" --key "$PKI/admin.key" \
    "https://127.0.0.1:$API_PORT/readyz" > /dev/null 2>&1
}

# etcd, then kube-apiserver, on ports picked now; returns 1 when either does not come up.
start_store_and_apiserver() {
  remove_store
  store_dir
  API_PORT="$(free_port)"
  local etcd_port etcd_peer
  etcd_port="$(free_port)"
  etcd_peer="$(free_port)"
  printf 'apiserver=%s\netcd=%s\n' "$API_PORT" "$etcd_port" > "$DIR/ports"

  # --unsafe-no-fsync: a throwaway store; fsync on every write makes the tests wait on the disk.
  start etcd "$BIN/etcd" --name test --data-dir "$(readlink -m "$DIR/etcd")" --unsafe-no-fsync \
    --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
    --listen-peer-urls "http://127.0.0.1:$etcd_peer" --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer" \
    --initial-cluster "test=http://127.0.0.1:$etcd_peer" --log-level warn
  await_component etcd "$(sed -n 1p "$DIR/pids")" 100 \
    curl -sf --max-time 1 -o /dev/null "http://127.0.0.1:$etcd_port/health" || return 1

  # The endpoint reconciler refuses a loopback advertise address; nothing here routes to the `kubernetes` Service.
  # Kubelets (the tests' log servers) are reached at their InternalIP only: never a DNS lookup of a node name.
  # Webhook and aggregated-API Services are reached at their EndpointSlices' addresses (no kube-proxy routes a
  # ClusterIP here): how the Kueue test reaches Kueue's webhooks.
  start kube-apiserver "$BIN/kube-apiserver" \
    --etcd-servers "http://127.0.0.1:$etcd_port" \
    --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$API_PORT" \
    --endpoint-reconciler-type none --kubelet-preferred-address-types InternalIP \
    --tls-cert-file "$PKI/apiserver.crt" --tls-private-key-file "$PKI/apiserver.key" \
    --client-ca-file "$PKI/ca.crt" --authorization-mode RBAC \
    --service-account-issuer https://kubernetes.default.svc \
    --service-account-key-file "$PKI/sa.pub" --service-account-signing-key-file "$PKI/sa.key" \
    --service-cluster-ip-range 10.96.0.0/24 --allow-privileged=false \
    --feature-gates "$FEATURE_GATES" --runtime-config "scheduling.k8s.io/v1beta1=true" \
    --enable-priority-and-fairness=false --profiling=false \
    --enable-aggregator-routing=true

  write_kubeconfig "$DIR/kubeconfig" admin
  write_kubeconfig "$DIR/controller-manager.kubeconfig" controller-manager
  write_kubeconfig "$DIR/scheduler.kubeconfig" scheduler

  local waited=0
  until readyz; do
    if ! kill -0 "$(sed -n 2p "$DIR/pids")" 2>/dev/null; then
      echo "test-cluster: kube-apiserver exited; its log ($DIR/logs/kube-apiserver.log) ends:" >&2
      tail -20 "$DIR/logs/kube-apiserver.log" >&2
      return 1
    fi
    if (( waited >= READY_TIMEOUT * 10 )); then
      echo "test-cluster: kube-apiserver not ready after ${READY_TIMEOUT}s; see $DIR/logs/" >&2
      return 1
    fi
    sleep 0.1
    waited=$((waited + 1))
  done
}

up() {
  stop_all
  BIN="$(bash "$HERE/testbin.sh")"
  mkdir -p "$DIR/logs"
  make_pki
  # A port picked free can be taken by another process before the component binds it: try again with new ports.
  local attempt
  for attempt in 1 2 3; do
    if start_store_and_apiserver; then
      break
    fi
    stop_all
    if (( attempt == 3 )); then
      exit 1
    fi
    echo "test-cluster: retrying with other ports" >&2
  done

  # Each controller acts as its own ServiceAccount (as kubeadm sets it up): the garbage collector's may delete any
  # kind, which the controller-manager's own identity may not.
  start kube-controller-manager "$BIN/kube-controller-manager" \
    --kubeconfig "$DIR/controller-manager.kubeconfig" --leader-elect=false \
    --use-service-account-credentials \
    --bind-address 127.0.0.1 --secure-port "$(free_port)" \
    --controllers garbage-collector-controller,namespace-controller,serviceaccount-controller,serviceaccount-token-controller,podgroup-protection-controller,clusterrole-aggregation-controller,resourcequota-controller \
    --service-account-private-key-file "$PKI/sa.key" --root-ca-file "$PKI/ca.crt" \
    --feature-gates "$FEATURE_GATES" --concurrent-gc-syncs 5
  start kube-scheduler "$BIN/kube-scheduler" \
    --kubeconfig "$DIR/scheduler.kubeconfig" --leader-elect=false \
    --bind-address 127.0.0.1 --secure-port "$(free_port)" --feature-gates "$FEATURE_GATES"
  if (( NODES > 0 )); then
    start_nodes
  fi
  echo "test-cluster: up, kubeconfig $DIR/kubeconfig (apiserver https://127.0.0.1:$API_PORT)" >&2
}

start_nodes() {  # the try-out nodes: the test kubelet as a process, until `down`
  local python="$ROOT/.venv/bin/python"
  if [[ ! -x "$python" ]]; then
    echo "test-cluster: --nodes needs $python: run 'bash scripts/setup.sh' first" >&2
    return 1
  fi
  (cd "$ROOT" && start nodes "$python" -m tests.operator.support.nodes "$DIR" --nodes "$NODES" --cwd "$ROOT")
  await_component nodes "$(tail -1 "$DIR/pids")" 300 grep -q "^nodes: " "$DIR/logs/nodes.log" || return 1
  echo "test-cluster: $NODES try-out node(s): pods run as local processes in $ROOT" >&2
}

case "$cmd" in
  up) up ;;
  down) stop_all; remove_store ;;
  env)
    echo "export KUBECONFIG=$DIR/kubeconfig"
    echo "export PATH=$(bash "$HERE/testbin.sh" --path):\$PATH"
    ;;
  *) usage ;;
esac
