#!/usr/bin/env bash
# The wheels bench/peers.py needs on the H200, which has no internet and no DeepSpeed: DeepSpeed 0.18.9
# built here from its sdist with no op prebuilt (DS_BUILD_OPS=0: a py3-none-any wheel; its cpu_adam op
# JIT-compiles there on first use, ~50 s, with the image's ninja and nvcc), and the requirements that
# the image lacks (cp312, manylinux x86_64). The image has the rest (einops, msgpack, ninja, numpy,
# packaging, psutil, py-cpuinfo, torch, tqdm). Writes .whl/ (ignored by git; ~4.3 MB).
#   run here:   bash bench/peers_wheels.sh      (needs pip, setuptools and torch in this python3)
#   use there:  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#                   --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps --no-binary :all: deepspeed==0.18.9 -d "$tmp"
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation "$tmp"/deepspeed-0.18.9.tar.gz -w .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    pydantic==2.11.10 pydantic-core==2.33.2 annotated-types==0.8.0 typing-inspection==0.4.5 \
    typing-extensions==4.15.0 hjson==3.1.0
rm -rf "$tmp"
ls -l .whl
