#!/usr/bin/env bash
# Builds the real Kubernetes control plane the live tests run on, from pinned sources, once per version:
# kube-apiserver, kube-controller-manager, kube-scheduler and kubectl from k8s.io/kubernetes, and etcd from the
# go.etcd.io/etcd/server/v3 release that same Kubernetes release pins (so one module graph builds all five).
# It then has scripts/kueuebin.sh build the other Go component the live tests run, Kueue, the same way.
#
#   scripts/testbin.sh          build what the cache lacks, then print the bin folder
#   scripts/testbin.sh --path   print the bin folder only (exit 1 if it is incomplete)
#
# The cache lives outside the repository (a fresh clone reuses it): $PARATRAIN_TESTBIN_CACHE, default
# ~/.cache/paratrain/testbin, one folder per Kubernetes version and build recipe. Needs Go >= 1.26 and the Go
# module proxy.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"

K8S_VERSION="v1.37.2"
# Bump when the build itself changes (flags, stamping): a cache built the old way is then rebuilt, beside it.
RECIPE=2
CACHE="${PARATRAIN_TESTBIN_CACHE:-$HOME/.cache/paratrain/testbin}"
BIN="$CACHE/k8s-$K8S_VERSION-r$RECIPE/bin"
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubectl etcd)

complete() {
  local b
  for b in "${BINARIES[@]}"; do [[ -x "$BIN/$b" ]] || return 1; done
}

if [[ "${1:-}" == "--path" ]]; then
  complete && echo "$BIN" && exit 0
  exit 1
fi
if complete; then
  bash "$HERE/kueuebin.sh" >&2
  echo "$BIN"
  exit 0
fi

if ! command -v go >/dev/null; then
  cat >&2 <<'EOF'
testbin: Go is not installed, and the live tests need a real Kubernetes control plane built from source.
Install Go 1.26 or newer (https://go.dev/doc/install, or `apt-get install golang-1.26`), then run
`bash scripts/testbin.sh` (about 15 minutes on 2 cores the first time; cached afterwards).
EOF
  exit 2
fi

echo "testbin: building Kubernetes $K8S_VERSION control plane into $BIN (first time only)" >&2
start=$SECONDS
work="$CACHE/k8s-$K8S_VERSION-r$RECIPE/module"
mkdir -p "$work" "$BIN"
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

# -trimpath and no debug info: smaller, reproducible binaries; the tests never debug them.
go build -trimpath -ldflags "-s -w$stamp" -o "$BIN/" \
  k8s.io/kubernetes/cmd/kube-apiserver \
  k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler \
  k8s.io/kubernetes/cmd/kubectl
go build -trimpath -ldflags "-s -w" -o "$BIN/etcd" go.etcd.io/etcd/server/v3
echo "$K8S_VERSION etcd $etcd_version" > "$BIN/VERSION"
echo "testbin: built in $((SECONDS - start)) s" >&2
complete
bash "$HERE/kueuebin.sh" >&2
echo "$BIN"
