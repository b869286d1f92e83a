#!/usr/bin/env bash
# The base image every paratrain image builds FROM where no image registry can be reached: Debian bookworm with
# Python 3.11, made from Debian's packages (debootstrap), so nothing is pulled. Where a registry is reachable the
# Dockerfiles' default base (python:3.11-slim-bookworm) serves as well: both give `python3 -m venv`.
#
#   bash scripts/base-image.sh          # builds paratrain-base:bookworm unless the daemon has it; prints its name
#   bash scripts/base-image.sh --force  # builds it again
#   bash scripts/base-image.sh --torch  # and on it paratrain-torch:2.13.0: a virtualenv with PyPI's torch (the CUDA
#                                       # build with its NVIDIA libraries), the GPU trainer image's base where
#                                       # pytorch/pytorch cannot be pulled:
#     docker build -f trainer/Dockerfile --build-arg PYTORCH_IMAGE="$(bash scripts/base-image.sh --torch)" .
#
# Needs a Docker daemon (scripts/docker.sh start) and root (debootstrap); installs debootstrap if missing.
# Mirror: $DEBIAN_MIRROR, else the first Debian mirror in this machine's apt sources, else deb.debian.org.
set -euo pipefail
IMAGE="paratrain-base:bookworm"
PACKAGES="python3,python3-venv,ca-certificates"

log() { printf 'base-image: %s\n' "$*" >&2; }

TORCH_IMAGE="paratrain-torch:2.13.0"

torch_image() {  # the GPU trainer's base: pip on PATH is the virtualenv's, so trainer/Dockerfile installs into it
  if ! docker image inspect "$TORCH_IMAGE" >/dev/null 2>&1; then
    log "building $TORCH_IMAGE on $IMAGE (PyPI's torch==2.13.0, several GB)"
    # shellcheck disable=SC2016  # $PATH expands in the image, not here
    printf '%s\n' "FROM $IMAGE" 'ENV PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1' \
      'RUN python3 -m venv /opt/venv && pip install "torch==2.13.0" && python -c "import torch"' \
      | docker build -q -t "$TORCH_IMAGE" - >/dev/null
  fi
  echo "$TORCH_IMAGE"
}

if [[ "${1:-}" != "--force" ]] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
  [[ "${1:-}" == "--torch" ]] && { torch_image; exit 0; }
  echo "$IMAGE"
  exit 0
fi
if ! command -v debootstrap >/dev/null; then
  log "installing debootstrap"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
fi
mirror="${DEBIAN_MIRROR:-$( (grep -rhoE 'https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list \
  /etc/apt/sources.list.d/ 2>/dev/null || true) | head -n 1 | tr -d ' ')}"
mirror="${mirror:-http://deb.debian.org/debian}"
root="$(mktemp -d -t paratrain-base.XXXXXX)"
trap 'rm -rf "$root"' EXIT
start=$SECONDS
log "debootstrap --variant=minbase bookworm from $mirror (with $PACKAGES)"
debootstrap --variant=minbase --include="$PACKAGES" bookworm "$root" "$mirror" >"$root.log" 2>&1 \
  || { tail -n 20 "$root.log" >&2; exit 1; }
rm -f "$root.log"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
# The machine's own extra certificate authorities (a TLS-inspecting proxy's, say), so builds FROM this image reach
# the package registries this machine reaches; pip and requests are pointed at the system bundle that includes them.
extra=(/usr/local/share/ca-certificates/*.crt)
if [[ -e "${extra[0]}" ]]; then
  log "trusting this machine's extra CAs: ${extra[*]##*/}"
  cp "${extra[@]}" "$root/usr/local/share/ca-certificates/"
  chroot "$root" update-ca-certificates >/dev/null
fi
bundle=/etc/ssl/certs/ca-certificates.crt
tar -C "$root" -c . | docker import --change 'ENV LANG=C.UTF-8' --change "ENV PIP_CERT=$bundle" \
  --change "ENV REQUESTS_CA_BUNDLE=$bundle" --change "ENV SSL_CERT_FILE=$bundle" --change 'CMD ["/bin/bash"]' \
  - "$IMAGE" >/dev/null
log "built $IMAGE in $((SECONDS - start)) s ($(docker image inspect -f '{{.Size}}' "$IMAGE") bytes)"
[[ "${1:-}" == "--torch" ]] && { torch_image; exit 0; }
echo "$IMAGE"
