#!/usr/bin/env bash
# Install gcore with SGLang's CPU engine into a fresh virtual environment of its own.
#
#   scripts/install_sglang_cpu.sh VENV_DIR
#
# Why a script and not a `gcore[sglang-cpu]` extra: the sglang wheel's own requirements are the GPU stack
# (sgl-kernel, flashinfer, a CUDA torch), so it must be installed with --no-deps and its CPU dependencies
# (upstream's python/pyproject_cpu.toml at the release, minus the torch family) installed beside it under a
# constraint that keeps the CPU torch. pip's extras cannot say --no-deps. See docs/engines.md.
set -euo pipefail
venv=${1:?usage: scripts/install_sglang_cpu.sh VENV_DIR}
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(dirname "$here")"
SGLANG_VERSION=0.5.15.post1
TORCH_VERSION=2.13.0

python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip
# torch first, pinned: a bare requirement may pull a multi-GB CUDA build
"$py" -m pip install -q "torch==$TORCH_VERSION"
"$py" -m pip install -q --no-deps "sglang==$SGLANG_VERSION"
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "torch==$TORCH_VERSION" >"$constraints"
# pip then reports sglang's GPU requirements (sglang-kernel, flashinfer, torch==2.11.0 ...) as missing or
# incompatible: expected, they are what --no-deps left out
"$py" -m pip install -q -c "$constraints" -r "$here/sglang-cpu-requirements.txt"
# the registry's torchvision (pulled in by timm) is a CUDA build; this lets it import next to the CPU torch
"$py" -m pip install -q "$here/torchvision-cpu-shim"
"$py" -m pip install -q -c "$constraints" -e "$repo[test]"
