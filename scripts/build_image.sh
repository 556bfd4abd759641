#!/usr/bin/env bash
# Build the two images of the Dockerfile with podman: llmserve:TAG (target server: scheduler, HTTP API, smg; no
# torch) and llmserve-worker:TAG (target worker). The base is made from Debian's packages with mmdebstrap (bookworm,
# python3.11) unless --base names one, so no container registry is needed. Images whose inputs (the Dockerfile,
# the sources it copies, the build arguments, the base) have not changed since they were built are kept, not rebuilt.
#
#   scripts/build_image.sh [--torch-variant cpu|cu128|...] [--torch-wheels DIR] [--ca-bundle FILE] [--base IMAGE]
#                          [--tag TAG] [--force]
#
#   --torch-variant  the torch build (default cpu): PyTorch's index https://download.pytorch.org/whl/<variant>
#   --torch-wheels   a directory holding that build's torch wheel (name ending +<variant>-...whl), used instead of
#                    PyTorch's index (offline builds); every other package still comes from PyPI
#   --ca-bundle      the CA bundle pip trusts during the build (default: $PIP_CERT when set, as the host's pip);
#                    mounted for the build only, not kept in the images
#   --base           a base image to build on instead of the Debian one (e.g. python:3.11-slim-bookworm)
#   --force          rebuild even when the images are up to date
# Environment: PODMAN (default `podman`; e.g. "podman --storage-driver=vfs"), BUILDAH_ISOLATION (default chroot:
# builds inside a container too), DEBIAN_MIRROR (default http://deb.debian.org/debian).
# It ends with a line `built in N s: llmserve:TAG X MB, llmserve-worker:TAG Y MB` (or `up to date: ...`).
set -euo pipefail
cd "$(dirname "$0")/.."

variant=cpu wheels="" wheel_list="" ca_bundle="${PIP_CERT:-}" base="" tag=latest force=0
while [ $# -gt 0 ]; do
  case "$1" in
    --torch-variant) variant="$2"; shift 2 ;;
    --torch-wheels) wheels="$2"; shift 2 ;;
    --ca-bundle) ca_bundle="$2"; shift 2 ;;
    --base) base="$2"; shift 2 ;;
    --tag) tag="$2"; shift 2 ;;
    --force) force=1; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "build_image.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ "$variant" =~ ^(cpu|cu[0-9]+|rocm[0-9.]+|xpu)$ ]] \
  || { echo "--torch-variant: '$variant' is not a PyTorch build (cpu, cu128, rocm6.4, xpu)" >&2; exit 2; }
# The files the arguments name, checked before anything is built (the Debian base alone takes minutes).
[ -z "$ca_bundle" ] || [ -f "$ca_bundle" ] || { echo "--ca-bundle: no file $ca_bundle" >&2; exit 2; }
if [ -n "$wheels" ]; then
  [ -d "$wheels" ] || { echo "--torch-wheels: no directory $wheels" >&2; exit 2; }
  wheels=$(cd "$wheels" && pwd)
  wheel_list=$(cd "$wheels" && ls torch-*+"$variant"-*.whl 2>/dev/null || true)
  [ -n "$wheel_list" ] || { echo "--torch-wheels: no torch-*+$variant-*.whl in $wheels" >&2; exit 2; }
fi
read -r -a podman <<< "${PODMAN:-podman}"
export BUILDAH_ISOLATION="${BUILDAH_ISOLATION:-chroot}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
server="llmserve:$tag" worker="llmserve-worker:$tag"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

label() {  # the io.llmserve.inputs label of an image, empty when there is no such image
  "${podman[@]}" image inspect --format '{{index .Labels "io.llmserve.inputs"}}' "$1" 2>/dev/null || true
}

# The Debian base: the packages the Dockerfile's base needs (python3 with venv, CA certificates for PyPI, apt for
# the worker's g++ and redis-server), no documentation.
if [ -z "$base" ]; then
  base="llmserve-base:bookworm"
  debian=(mmdebstrap --variant=apt --include=python3,python3-venv,ca-certificates
          --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*'
          --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright'
          bookworm "$work/base.tar" "$mirror")
  base_inputs=$(echo "${debian[*]}" | sed "s|$work|WORK|" | sha256sum | cut -c1-16)
  if [ "$force" = 1 ] || [ "$(label "$base")" != "$base_inputs" ]; then
    command -v mmdebstrap >/dev/null || { echo "mmdebstrap is missing: apt-get install mmdebstrap" >&2; exit 1; }
    echo "== making $base with mmdebstrap (Debian bookworm from $mirror)"
    "${debian[@]}" >"$work/mmdebstrap.log" 2>&1 || { cat "$work/mmdebstrap.log" >&2; exit 1; }
    "${podman[@]}" import --change "LABEL io.llmserve.inputs=$base_inputs" --change 'CMD ["/bin/bash"]' \
      "$work/base.tar" "$base" >/dev/null
    rm -f "$work/base.tar"
  fi
fi

# torch from a local directory: a one-project PEP 503 index of it, mounted into the build.
build_args=(--build-arg "BASE_IMAGE=$base" --build-arg "TORCH_VARIANT=$variant")
if [ -n "$ca_bundle" ]; then
  build_args+=(--build-arg "PIP_CERT=/run/build-ca-bundle.pem" -v "$(realpath "$ca_bundle"):/run/build-ca-bundle.pem:ro")
fi
if [ -n "$wheels" ]; then
  mkdir -p "$work/index/torch"
  for w in $wheel_list; do echo "<a href=\"file:///torch-wheels/${w//+/%2B}\">$w</a>"; done > "$work/index/torch/index.html"
  build_args+=(--build-arg "TORCH_INDEX_URL=file:///torch-index" -v "$work/index:/torch-index:ro"
               -v "$wheels:/torch-wheels:ro")
  wheel_list=$(cd "$wheels" && sha256sum $wheel_list)
fi

# What the images are made of: the files the build context keeps (.dockerignore), the arguments, the base.
sources=$(find Dockerfile .dockerignore pyproject.toml scripts/constraints.txt scripts/pyproject_requirements.py \
            api_svc common kernels llmserve protos scheduler_svc worker_svc \
            -type f -not -path '*/__pycache__/*' -not -name '*.pyc' | LC_ALL=C sort | xargs sha256sum)
inputs=$(printf '%s\n' "$sources" "variant=$variant" "$wheel_list" "base=$base" \
           "$("${podman[@]}" image inspect --format '{{.Id}}' "$base" 2>/dev/null || echo "$base")" \
         | sha256sum | cut -c1-16)
if [ "$force" = 0 ] && [ "$(label "$server")" = "$inputs" ] && [ "$(label "$worker")" = "$inputs" ]; then
  state="up to date:"
else
  start=$(date +%s)
  for target in server worker; do
    name=$server; [ "$target" = worker ] && name=$worker
    echo "== building $name (target $target, torch $variant, base $base)"
    "${podman[@]}" build --target "$target" --tag "$name" --build-arg "LLMSERVE_INPUTS=$inputs" "${build_args[@]}" .
  done
  # The images these replaced (and their build leftovers) keep no tag: drop them.
  "${podman[@]}" image prune -f >/dev/null
  state="built in $(( $(date +%s) - start )) s:"
fi
size() { "${podman[@]}" image inspect --format '{{.Size}}' "$1" | awk '{printf "%d MB", $1 / 1e6}'; }
echo "$state $server $(size "$server"), $worker $(size "$worker")"
