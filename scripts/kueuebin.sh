#!/usr/bin/env bash
# Builds the real Kueue controller manager the Kueue live test runs, from its pinned Go module, once per version,
# and keeps beside it the module's config/ folder: the kustomization its release manifests are built from
# (`kubectl kustomize config/default`: CRDs, RBAC, webhooks, the manager's Configuration).
#
#   scripts/kueuebin.sh          build what the cache lacks, then print the folder (bin/kueue, config/)
#   scripts/kueuebin.sh --path   print the folder only (exit 1 if it is incomplete)
#
# The cache lives beside the control plane's ($PARATRAIN_TESTBIN_CACHE, default ~/.cache/paratrain/testbin), so a
# fresh clone reuses it. Needs Go >= 1.26 and the Go module proxy. Two builds at once (CI and a developer's shell)
# take turns on a lock: two unlocked builds once raced on one temporary file and one of them failed.
set -euo pipefail

KUEUE_VERSION="v0.17.0"
# Bump when the build itself changes: a cache built the old way is then rebuilt, beside it.
RECIPE=1
CACHE="${PARATRAIN_TESTBIN_CACHE:-$HOME/.cache/paratrain/testbin}"
DIR="$CACHE/kueue-$KUEUE_VERSION-r$RECIPE"

complete() {
  [[ -x "$DIR/bin/kueue" && -f "$DIR/config/default/kustomization.yaml" ]]
}

if [[ "${1:-}" == "--path" ]]; then
  complete && echo "$DIR" && exit 0
  exit 1
fi
if complete; then
  echo "$DIR"
  exit 0
fi

if ! command -v go >/dev/null; then
  echo "kueuebin: Go 1.26 or newer is needed to build Kueue (https://go.dev/doc/install)" >&2
  exit 2
fi

mkdir -p "$DIR"
exec 9>"$DIR.lock"
flock 9  # a concurrent build finishes first; what it built is then reused
if complete; then
  echo "$DIR"
  exit 0
fi

echo "kueuebin: building Kueue $KUEUE_VERSION into $DIR (first time only)" >&2
start=$SECONDS
work="$DIR/module"
mkdir -p "$work" "$DIR/bin"
cd "$work"
export GOFLAGS="-mod=mod" GOTOOLCHAIN=local CGO_ENABLED=0
printf 'module paratrain.dev/kueuebin\n\ngo 1.26\n' > go.mod
go get "sigs.k8s.io/kueue@$KUEUE_VERSION" >/dev/null
go build -trimpath -o "$DIR/bin/kueue.tmp" sigs.k8s.io/kueue/cmd/kueue

src="$(go mod download -json "sigs.k8s.io/kueue@$KUEUE_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')"
rm -rf "$DIR/config"
cp -r "$src/config" "$DIR/config"
chmod -R u+w "$DIR/config"  # the module cache is read-only
mv "$DIR/bin/kueue.tmp" "$DIR/bin/kueue"
echo "kueuebin: built in $((SECONDS - start))s" >&2
echo "$DIR"
