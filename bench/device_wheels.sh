#!/usr/bin/env bash
# Fetch (here, where pip reaches PyPI) the wheels that memlm's training path
# needs and the lent GPU machine's image lacks (Python 3.12: hydra-core,
# omegaconf, torchdata), into .whl/ (ignored by git); bench/device_check.sh
# installs them there one at a time with `pip install --no-index` into a
# temporary folder, printing that machine's Python version and each wheel's
# outcome. Versions are constraints.txt's (the ones the suite runs with).
# Pure-Python wheels except zstandard (a cp312 manylinux binary, only needed
# to read .zst corpora): on another Python it is refused, and said so.
#
#   bash bench/device_wheels.sh        # then carry ".whl" to the device run
#   PIP=".venv/bin/python -m pip" bash bench/device_wheels.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PIP="${PIP:-python3 -m pip}"
pinned() { grep -iE "^$1==" constraints.txt | head -n 1; }
mkdir -p .whl
$PIP download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$(pinned hydra-core)" "$(pinned omegaconf)" "$(pinned torchdata)" "$(pinned zstandard)" dill==0.4.0
# omegaconf 2.3 needs antlr4 4.9.*, published only as a source archive: build
# its (pure-Python) wheel here.
$PIP wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3
ls -l .whl
