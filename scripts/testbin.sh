#!/usr/bin/env bash
# Builds the real Kubernetes control plane the live tests run on, from pinned sources, once per version:
# kube-apiserver, kube-controller-manager, kube-scheduler and kubectl from k8s.io/kubernetes, and etcd from the
# go.etcd.io/etcd/server/v3 release that same Kubernetes release pins (so one module graph builds all five).
# It then has scripts/kueuebin.sh build the other Go component the live tests run, Kueue, the same way.
#
#   scripts/testbin.sh          build what the cache lacks, then print the bin folder
#   scripts/testbin.sh --path   print the bin folder only (exit 1 if it is incomplete)
#   scripts/testbin.sh --node   the same, plus a node's binaries from the same module graph (kubelet, kubeadm,
#                               kube-proxy: the kind node image, scripts/kindbin.sh); Kueue is left out
#
# The cache lives outside the repository (a fresh clone reuses it): $PARATRAIN_TESTBIN_CACHE, default
# ~/.cache/paratrain/testbin, one folder per Kubernetes version and build recipe. Needs Go >= 1.26 and the Go
# module proxy. Two builds at once (CI and a developer's shell) take turns on a lock; the second reuses the first's.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"

K8S_VERSION="v1.37.2"
# Bump when the build itself changes (flags, stamping): a cache built the old way is then rebuilt, beside it.
RECIPE=2
CACHE="${PARATRAIN_TESTBIN_CACHE:-$HOME/.cache/paratrain/testbin}"
BIN="$CACHE/k8s-$K8S_VERSION-r$RECIPE/bin"
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubectl etcd)
NODE_BINARIES=(kubelet kubeadm kube-proxy)

has() {  # has BINARY...: every one is built
  local b
  for b in "$@"; do [[ -x "$BIN/$b" ]] || return 1; done
}
complete() { has "${BINARIES[@]}"; }

mode="${1:-}"
if [[ "$mode" == "--path" ]]; then
  complete && echo "$BIN" && exit 0
  exit 1
fi
wanted=("${BINARIES[@]}")
[[ "$mode" != "--node" ]] || wanted+=("${NODE_BINARIES[@]}")
finish() {
  exec 9>&-  # this version's lock (if held) goes before Kueue builds: a waiting kind build needs none of Kueue
  [[ "$mode" == "--node" ]] || bash "$HERE/kueuebin.sh" >&2
  echo "$BIN"
  exit 0
}
has "${wanted[@]}" && finish

if ! command -v go >/dev/null; then
  cat >&2 <<'EOF'
testbin: Go is not installed, and the live tests need a real Kubernetes control plane built from source.
Install Go 1.26 or newer (https://go.dev/doc/install, or `apt-get install golang-1.26`), then run
`bash scripts/testbin.sh` (about 15 minutes on 2 cores the first time; cached afterwards).
EOF
  exit 2
fi

mkdir -p "$BIN"
exec 9>"$BIN.lock"
flock 9  # a concurrent build of this version finishes first; what it built is then reused
has "${wanted[@]}" && finish

start=$SECONDS
work="$CACHE/k8s-$K8S_VERSION-r$RECIPE/module"
mkdir -p "$work" "$BIN/.tmp"
cd "$work"
export GOFLAGS="-mod=mod" GOTOOLCHAIN=local CGO_ENABLED=0

# k8s.io/kubernetes replaces its staging modules with local paths, so it cannot be built as a dependency as is.
# The wrapper module maps each of those replaces to the published staging module of the same release
# (k8s.io/X v0.N.M for Kubernetes v1.N.M), read from the release's own go.mod rather than written by hand.
kmod="$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')"
staging_version="v0.${K8S_VERSION#v1.}"
{
  echo "module paratrain.dev/testbin"
  echo
  grep -E '^go [0-9.]+$' "$kmod"
  grep -E '^godebug ' "$kmod" || true
  echo
  echo "require k8s.io/kubernetes $K8S_VERSION"
  echo
  echo "replace ("
  sed -nE "s#^[[:space:]]*(k8s\.io/[a-z0-9-]+) => \./staging/src/k8s\.io/[a-z0-9-]+\$#\t\1 => \1 $staging_version#p" "$kmod"
  echo ")"
} > go.mod
etcd_version="$(awk '$1 == "go.etcd.io/etcd/server/v3" {print $2}' "$kmod")"
go get "go.etcd.io/etcd/server/v3@$etcd_version" >/dev/null

# The version the binaries report (/version, `kubectl version`), stamped as Kubernetes' own build does
# (hack/lib/version.sh): unstamped, they say v0.0.0-master, and clients that check the server's version
# refuse it (Helm: a chart's `kubeVersion: >=1.30.0-0` is "incompatible with Kubernetes v0.0.0-master").
minor="${K8S_VERSION#v1.}"
minor="${minor%%.*}"
stamp=""
for pkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
  stamp+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
done

# -trimpath and no debug info: smaller, reproducible binaries; the tests never debug them. Each is built under
# .tmp/ and moved in whole, so an interrupted build never leaves a binary that looks complete.
build() {  # build PACKAGE...
  local pkg
  go build -trimpath -ldflags "-s -w$stamp" -o "$BIN/.tmp/" "$@"
  for pkg in "$@"; do mv "$BIN/.tmp/${pkg##*/}" "$BIN/${pkg##*/}"; done
}
if ! complete; then
  echo "testbin: building Kubernetes $K8S_VERSION control plane into $BIN (first time only)" >&2
  build k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl
  go build -trimpath -ldflags "-s -w" -o "$BIN/.tmp/etcd" go.etcd.io/etcd/server/v3
  mv "$BIN/.tmp/etcd" "$BIN/etcd"
  echo "$K8S_VERSION etcd $etcd_version" > "$BIN/VERSION"
fi
if ! has "${wanted[@]}"; then
  echo "testbin: building Kubernetes $K8S_VERSION node binaries (${NODE_BINARIES[*]}) into $BIN" >&2
  build k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kubeadm k8s.io/kubernetes/cmd/kube-proxy
fi
echo "testbin: built in $((SECONDS - start)) s" >&2
has "${wanted[@]}"
finish
