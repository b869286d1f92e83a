#!/usr/bin/env bash
# Builds kind, helm and a kind node image for Kubernetes v1.37.2 from source, once per recipe, so that
# `kind create cluster` pulls nothing: every binary comes from its Go module (the Go module proxy), the node's
# operating system from Debian's packages (debootstrap), and every image the node runs is built here and preloaded.
#
#   scripts/kindbin.sh          build what the cache lacks, then print the bin folder (kind, helm, kubectl)
#   scripts/kindbin.sh --path   print the bin folder only (exit 1 if it or the node image is missing)
#   scripts/kindbin.sh --image  print the node image's name
#
# What the node holds (kind's own base recipe, images/base in the kind module, with each component built from its
# Go module instead of a git clone):
#   containerd, ctr, containerd-shim-runc-v2   github.com/containerd/containerd/v2   $CONTAINERD_VERSION
#   runc (static, with seccomp)                github.com/opencontainers/runc        $RUNC_VERSION
#   crictl                                     sigs.k8s.io/cri-tools                 $CRICTL_VERSION
#   CNI plugins host-local loopback ptp portmap github.com/containernetworking/plugins $CNI_PLUGINS_VERSION
#   kubelet, kubeadm, kubectl, kube-proxy      k8s.io/kubernetes (scripts/testbin.sh's module graph)
# and these images, preloaded:
#   kube-apiserver, kube-controller-manager, kube-scheduler, kube-proxy, etcd, pause   (the names kubeadm asks for)
#   CoreDNS $COREDNS_VERSION (kubeadm's pin), the local-path provisioner $LOCAL_PATH_VERSION and its helper,
#   the pod network: scripts/kind-node/network-agent.sh (routes and the CNI config, what kindnetd does, whose
#   module the proxy does not serve) and kube-network-policies $NETPOL_VERSION (NetworkPolicy enforcement).
# Not built: fuse-overlayfs (rootless kind only), NFS and iSCSI tools.
#
# Needs Go >= 1.26, gcc with Debian's libseccomp-dev (installed if missing), root (debootstrap) and a Docker daemon
# (scripts/docker.sh start). The cache lives beside the control plane's: $PARATRAIN_TESTBIN_CACHE, default
# ~/.cache/paratrain/testbin. Two builds at once (CI and a shell) take turns on a lock.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"

KIND_VERSION="v0.33.0"
K8S_VERSION="v1.37.2"
CONTAINERD_VERSION="v2.3.4"
RUNC_VERSION="v1.4.3"
CRICTL_VERSION="v1.36.0"
CNI_PLUGINS_VERSION="v1.9.1"
COREDNS_VERSION="v1.14.6"
LOCAL_PATH_VERSION="v0.0.30"  # kind 0.33 ships v0.0.34, which the module proxy does not serve
NETPOL_VERSION="v0.8.0"
HELM_VERSION="v3.22.0"
# Bump when the build changes: the old cache and node image are then rebuilt, beside it.
RECIPE=1
CACHE="${PARATRAIN_TESTBIN_CACHE:-$HOME/.cache/paratrain/testbin}"
DIR="$CACHE/kind-$KIND_VERSION-k8s-$K8S_VERSION-r$RECIPE"
BIN="$DIR/bin"
NODE_IMAGE="paratrain.local/kind-node:$K8S_VERSION-r$RECIPE"
OS_IMAGE="paratrain.local/kind-node-os:bookworm-r$RECIPE"
LOCAL_REGISTRY="paratrain.local"  # the registry name of every image built here; none is ever pulled

log() { printf 'kindbin: %s\n' "$*" >&2; }

complete() {
  [[ -x "$BIN/kind" && -x "$BIN/helm" && -x "$BIN/kubectl" ]] && docker image inspect "$NODE_IMAGE" >/dev/null 2>&1
}

case "${1:-}" in
  --path) complete && echo "$BIN" && exit 0; exit 1 ;;
  --image) echo "$NODE_IMAGE"; exit 0 ;;
esac

mkdir -p "$DIR"
exec 9>"$DIR.lock"
flock 9  # another build of this recipe finishes first; its result is then reused
if complete; then
  echo "$BIN"
  exit 0
fi

start=$SECONDS
export GOFLAGS="-mod=mod" GOTOOLCHAIN=local CGO_ENABLED=0
mkdir -p "$BIN" "$DIR/node" "$DIR/images" "$DIR/src"

module_dir() {  # module_dir MODULE VERSION: the module's source in the module cache
  go mod download -json "$1@$2" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])'
}

# go_build MODULE VERSION OUT PACKAGE... [-- GO BUILD FLAGS]: builds packages of a module inside a writable copy of
# its source, so its own go.mod (replace directives included) and go.sum decide the dependencies, as its own release
# build does.
go_build() {
  local mod=$1 version=$2 out=$3
  shift 3
  local pkgs=() flags=()
  while (($#)); do
    if [[ $1 == -- ]]; then shift; flags=("$@"); break; fi
    pkgs+=("$1"); shift
  done
  local src="$DIR/src/${mod//\//_}@$version"
  if [[ ! -d "$src" ]]; then
    cp -r "$(module_dir "$mod" "$version")" "$src.tmp"
    chmod -R u+w "$src.tmp"
    mv "$src.tmp" "$src"
  fi
  # Built under .tmp/ and moved in whole, so an interrupted build never leaves a binary `built` would trust.
  local tmp="$DIR/.tmp"
  rm -rf "$tmp" && mkdir -p "$tmp"
  if [[ "$out" == */ ]]; then
    (cd "$src" && go build -trimpath "${flags[@]}" -o "$tmp/" "${pkgs[@]}")
    mv "$tmp"/* "$out"
  else
    (cd "$src" && go build -trimpath "${flags[@]}" -o "$tmp/${out##*/}" "${pkgs[@]}")
    mv "$tmp/${out##*/}" "$out"
  fi
}

built() {  # built FILE...: every file exists (a step's outputs), so the step is skipped
  local f
  for f in "$@"; do [[ -e "$f" ]] || return 1; done
}

# --- tools on the user's side: kind, helm, kubectl -------------------------------------------------------------
if ! built "$BIN/kind"; then
  log "kind $KIND_VERSION"
  go_build sigs.k8s.io/kind "$KIND_VERSION" "$BIN/kind" . -- -ldflags "-s -w"
fi
if ! built "$BIN/helm"; then
  log "helm $HELM_VERSION"
  go_build helm.sh/helm/v3 "$HELM_VERSION" "$BIN/helm" ./cmd/helm -- \
    -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
fi

# --- the node's runtime ----------------------------------------------------------------------------------------
node="$DIR/node"
if ! built "$node/containerd" "$node/ctr" "$node/containerd-shim-runc-v2"; then
  log "containerd $CONTAINERD_VERSION"
  go_build github.com/containerd/containerd/v2 "$CONTAINERD_VERSION" "$node/" \
    ./cmd/containerd ./cmd/ctr ./cmd/containerd-shim-runc-v2 -- -tags "no_aufs no_zfs no_btrfs no_devmapper" \
    -ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION"
fi
if ! built "$node/runc"; then
  log "runc $RUNC_VERSION (static, seccomp)"
  if [[ ! -f /usr/lib/x86_64-linux-gnu/libseccomp.a ]] && command -v apt-get >/dev/null; then
    apt-get install -y -qq libseccomp-dev >/dev/null
  fi
  # cgo: runc's nsenter is C; seccomp: the restricted Pod Security profile asks every pod for RuntimeDefault.
  CGO_ENABLED=1 go_build github.com/opencontainers/runc "$RUNC_VERSION" "$node/runc" . -- \
    -tags "seccomp netgo osusergo urfave_cli_no_docs" \
    -ldflags "-s -w -X main.version=${RUNC_VERSION#v} -extldflags -static"
fi
if ! built "$node/crictl"; then
  log "crictl $CRICTL_VERSION"
  go_build sigs.k8s.io/cri-tools "$CRICTL_VERSION" "$node/crictl" ./cmd/crictl -- \
    -ldflags "-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version=$CRICTL_VERSION"
fi
if ! built "$node/cni/ptp" "$node/cni/host-local" "$node/cni/loopback" "$node/cni/portmap"; then
  log "CNI plugins $CNI_PLUGINS_VERSION"
  mkdir -p "$node/cni"
  go_build github.com/containernetworking/plugins "$CNI_PLUGINS_VERSION" "$node/cni/" \
    ./plugins/ipam/host-local ./plugins/main/loopback ./plugins/main/ptp ./plugins/meta/portmap -- -ldflags "-s -w"
fi

# --- what the node's images hold -------------------------------------------------------------------------------
if ! built "$node/coredns"; then
  log "CoreDNS $COREDNS_VERSION"
  go_build github.com/coredns/coredns "$COREDNS_VERSION" "$node/coredns" . -- -ldflags "-s -w"
fi
if ! built "$node/local-path-provisioner"; then
  log "local-path-provisioner $LOCAL_PATH_VERSION"
  go_build github.com/rancher/local-path-provisioner "$LOCAL_PATH_VERSION" "$node/local-path-provisioner" . -- \
    -ldflags "-s -w -X main.VERSION=$LOCAL_PATH_VERSION"
fi
if ! built "$node/kube-network-policies"; then
  log "kube-network-policies $NETPOL_VERSION"
  go_build sigs.k8s.io/kube-network-policies "$NETPOL_VERSION" "$node/kube-network-policies" ./cmd -- -ldflags "-s -w"
fi
if ! built "$node/pause"; then
  log "pause (Kubernetes' own pause.c, static)"
  kdir="$(cd "$DIR/src" && module_dir k8s.io/kubernetes "$K8S_VERSION")"
  gcc -Os -static -DVERSION="$K8S_VERSION" -o "$node/pause.tmp" "$kdir/build/pause/linux/pause.c"
  strip "$node/pause.tmp" && mv "$node/pause.tmp" "$node/pause"
fi

# the Kubernetes binaries, from scripts/testbin.sh's module graph
testbin="$(bash "$HERE/testbin.sh" --node)"  # kubectl, the control plane, etcd, kubelet, kubeadm, kube-proxy
ln -sf "$testbin/kubectl" "$BIN/kubectl"

with_node_config() {  # with_node_config FROM TAG: FROM with a kind node's entrypoint, stop signal and environment
  # (`docker import` and `docker commit` cannot set STOPSIGNAL; a build of metadata only adds no layer)
  printf '%s\n' "FROM $1" 'ENV container=docker' 'STOPSIGNAL SIGRTMIN+3' \
    'ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]' 'CMD []' | docker build -q -t "$2" - >/dev/null
  docker rmi "$1" >/dev/null
}

# --- the node's operating system: Debian with what kind's base image installs ------------------------------------
kind_src="$(cd "$DIR/src" && module_dir sigs.k8s.io/kind "$KIND_VERSION")"
if ! docker image inspect "$OS_IMAGE" >/dev/null 2>&1; then
  log "node OS: debootstrap bookworm"
  command -v debootstrap >/dev/null || apt-get install -y -qq debootstrap >/dev/null
  mirror="${DEBIAN_MIRROR:-$( (grep -rhoE 'https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list \
    /etc/apt/sources.list.d/ 2>/dev/null || true) | head -n 1 | tr -d ' ')}"
  mirror="${mirror:-http://deb.debian.org/debian}"
  root="$(mktemp -d -t paratrain-kind-os.XXXXXX)"
  packages="systemd,conntrack,iptables,nftables,iproute2,ethtool,util-linux,mount,kmod,libseccomp2,pigz,e2fsprogs"
  packages+=",bash,ca-certificates,curl,jq,procps"
  debootstrap --variant=minbase --include="$packages" bookworm "$root" "$mirror" >"$root.log" 2>&1 \
    || { tail -n 20 "$root.log" >&2; rm -rf "$root"; exit 1; }
  rm -rf "$root.log" "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  # kind's base files (systemd units, the entrypoint, containerd's and the kubelet's configuration), from its module
  files="$kind_src/images/base/files"
  install -m 0755 "$files"/usr/local/bin/* "$root/usr/local/bin/"
  mkdir -p "$root/kind/bin" "$root/etc/containerd" "$root/etc/systemd/system/kubelet.service.d" \
    "$root/etc/kubernetes/manifests" "$root/opt/cni/bin" "$root/kind/manifests"
  install -m 0755 "$files"/kind/bin/* "$root/kind/bin/"
  install -m 0644 "$files/etc/crictl.yaml" "$root/etc/"
  install -m 0644 "$files"/etc/containerd/* "$root/etc/containerd/"
  install -m 0644 "$files"/etc/default/* "$root/etc/default/"
  install -m 0644 "$files"/etc/sysctl.d/* "$root/etc/sysctl.d/"
  install -m 0644 "$files"/etc/systemd/system/*.service "$files"/etc/systemd/system/*.slice "$root/etc/systemd/system/"
  install -m 0644 "$files"/etc/systemd/system/kubelet.service.d/* "$root/etc/systemd/system/kubelet.service.d/"
  # as kind's Dockerfile: no getty, udev or tmpfiles set-up inside a container; systemd is the init
  find "$root/lib/systemd/system/sysinit.target.wants/" -name "systemd-tmpfiles-setup.service" -delete
  rm -f "$root"/lib/systemd/system/multi-user.target.wants/* "$root"/etc/systemd/system/*.wants/* \
    "$root"/lib/systemd/system/local-fs.target.wants/* "$root"/lib/systemd/system/sockets.target.wants/*udev* \
    "$root"/lib/systemd/system/sockets.target.wants/*initctl* "$root"/lib/systemd/system/basic.target.wants/*
  echo "ReadKMsg=no" >> "$root/etc/systemd/journald.conf"
  ln -sf /usr/lib/systemd/systemd "$root/sbin/init"
  systemctl --root="$root" enable kubelet.service containerd.service undo-mount-hacks.service >/dev/null 2>&1
  systemctl --root="$root" mask systemd-binfmt.service >/dev/null 2>&1
  tar -C "$root" -c . | docker import - "$OS_IMAGE.rootfs" >/dev/null
  rm -rf "$root"
  with_node_config "$OS_IMAGE.rootfs" "$OS_IMAGE"
fi

# --- the images, built and saved as archives for containerd -------------------------------------------------------
ctx="$(mktemp -d -t paratrain-kind-ctx.XXXXXX)"
trap 'rm -rf "$ctx"' EXIT
image_archive() {  # image_archive NAME FROM ENTRYPOINT|- [FILE...]: FROM plus the files in /usr/local/bin, saved once
  local name=$1 from=$2 entrypoint=$3 tar="$DIR/images/${1//[\/:]/_}.tar"
  shift 3
  [[ -f "$tar" ]] && return 0
  rm -rf "$ctx" && mkdir -p "$ctx/bin"
  (($# == 0)) || cp "$@" "$ctx/bin/"
  {
    printf 'FROM %s\nCOPY bin/ /usr/local/bin/\nENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n' "$from"
    [[ "$entrypoint" == - ]] || printf 'ENTRYPOINT ["%s"]\n' "$entrypoint"
  } > "$ctx/Dockerfile"
  docker build -q -t "$name" "$ctx" >/dev/null
  docker save "$name" -o "$tar.tmp" && mv "$tar.tmp" "$tar"
}
mapfile -t kubeadm_images < <("$testbin/kubeadm" config images list --kubernetes-version "$K8S_VERSION")
for image in "${kubeadm_images[@]}"; do
  component="${image##*/}"
  component="${component%%:*}"
  case "$component" in
    kube-proxy) image_archive "$image" "$OS_IMAGE" - "$testbin/kube-proxy" ;;  # it runs iptables and conntrack
    kube-*) image_archive "$image" scratch - "$testbin/$component" ;;
    etcd) image_archive "$image" scratch - "$testbin/etcd" ;;
    coredns) image_archive "$image" scratch /usr/local/bin/coredns "$node/coredns" ;;  # its Deployment gives args only
    pause) pause_image="$image"; image_archive "$image" scratch /usr/local/bin/pause "$node/pause" ;;
    *) log "kubeadm asks for an image this recipe does not build: $image"; exit 1 ;;
  esac
done
provisioner_image="$LOCAL_REGISTRY/local-path-provisioner:$LOCAL_PATH_VERSION"
helper_image="$LOCAL_REGISTRY/local-path-helper:bookworm-r$RECIPE"
network_image="$LOCAL_REGISTRY/kind-network:r$RECIPE"
netpol_image="$LOCAL_REGISTRY/kube-network-policies:$NETPOL_VERSION"
image_archive "$provisioner_image" scratch - "$node/local-path-provisioner"
image_archive "$helper_image" "$OS_IMAGE" -  # its pods run sh, mkdir and rm
image_archive "$network_image" "$OS_IMAGE" - "$HERE/kind-node/network-agent.sh" "$testbin/kubectl"
image_archive "$netpol_image" scratch - "$node/kube-network-policies"

# --- the node image: the OS, the binaries, the manifests kind applies, the images preloaded ------------------------
log "node image $NODE_IMAGE"
build="paratrain-kind-build-$$"
docker rm -f "$build" >/dev/null 2>&1 || true
docker run -d --name "$build" --privileged --entrypoint sleep -v "$DIR/images:/kind-images:ro" "$OS_IMAGE" infinity \
  >/dev/null
trap 'docker rm -f "$build" >/dev/null 2>&1 || true; rm -rf "$ctx"' EXIT
put() {  # put MODE FILE... DEST: files copied into the build container
  local mode=$1 dest="${*: -1}" f
  for f in "${@:2:$#-2}"; do
    docker cp "$f" "$build:$dest/"
    docker exec "$build" chmod "$mode" "$dest/$(basename "$f")"
  done
}
put 0755 "$node/containerd" "$node/ctr" "$node/containerd-shim-runc-v2" "$node/crictl" /usr/local/bin
put 0755 "$node/runc" /usr/local/sbin
put 0755 "$node"/cni/* /opt/cni/bin
put 0755 "$testbin/kubelet" "$testbin/kubeadm" "$testbin/kubectl" /usr/bin
# the default CNI and StorageClass manifests kind applies at create time
sed -e "s#@NETWORK_IMAGE@#$network_image#; s#@NETPOL_IMAGE@#$netpol_image#" "$HERE/kind-node/default-cni.yaml" \
  > "$ctx/default-cni.yaml"
python3 "$HERE/kind-node/storage_manifest.py" "$kind_src/pkg/build/nodeimage/const_storage.go" \
  "$provisioner_image" "$helper_image" > "$ctx/default-storage.yaml"
printf '%s' "$K8S_VERSION" > "$ctx/version"
put 0644 "$ctx/default-cni.yaml" "$ctx/default-storage.yaml" /kind/manifests
put 0644 "$ctx/version" /kind
put 0755 "$HERE/kind-node/restrict-oom-score.sh" /kind/bin
printf '[Service]\nExecStartPre=/kind/bin/restrict-oom-score.sh\n' > "$ctx/10-restrict-oom-score.conf"
docker exec "$build" mkdir -p /etc/systemd/system/containerd.service.d
put 0644 "$ctx/10-restrict-oom-score.conf" /etc/systemd/system/containerd.service.d
docker exec "$build" bash -euo pipefail -c "
  sed -i 's#sandbox_image = .*#sandbox_image = \"$pause_image\"#' /etc/containerd/config.toml
  ctr oci spec | jq '.hooks.createContainer[.hooks.createContainer| length] |= . + {\"path\": \"/kind/bin/mount-product-files.sh\"}' \
    | jq 'del(.process.rlimits)' > /etc/containerd/cri-base.json
  nohup containerd >/tmp/containerd.log 2>&1 &
  for i in \$(seq 50); do [ -S /run/containerd/containerd.sock ] && ctr version >/dev/null 2>&1 && break; sleep 0.2; done
  for archive in /kind-images/*.tar; do
    ctr --namespace=k8s.io images import --label=io.cri-containerd.pinned=pinned --all-platforms --no-unpack \
      --digests \"\$archive\" >/dev/null
  done
  ctr --namespace=k8s.io images list -q | grep -v '^sha256:' | sort
  pkill containerd; while pgrep -x containerd >/dev/null; do sleep 0.2; done
  rm -rf /tmp/* /run/containerd
" >&2
docker commit "$build" "$NODE_IMAGE.committed" >/dev/null
with_node_config "$NODE_IMAGE.committed" "$NODE_IMAGE"
log "built in $((SECONDS - start)) s: $NODE_IMAGE ($(docker image inspect -f '{{.Size}}' "$NODE_IMAGE") bytes)"
complete
echo "$BIN"
