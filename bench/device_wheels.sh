#!/usr/bin/env bash
# Fetch (here, where pip reaches PyPI) the wheels that memlm's training path
# needs and the lent H200 machine's Python 3.12 image lacks, into .whl/
# (ignored by git); bench/device_check.sh installs them there with
# `pip install --no-index` into a temporary folder. Pure-Python wheels
# except zstandard (a manylinux binary, only needed to read .zst corpora).
#
#   bash bench/device_wheels.sh        # then carry ".whl" to the device run
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PIP="${PIP:-python3 -m pip}"
mkdir -p .whl
$PIP download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl hydra-core==1.3.2 omegaconf==2.3.0 torchdata==0.11.0 zstandard==0.25.0 dill==0.4.0
# omegaconf 2.3 needs antlr4 4.9.*, published only as a source archive: build
# its (pure-Python) wheel here.
$PIP wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3
ls -l .whl
