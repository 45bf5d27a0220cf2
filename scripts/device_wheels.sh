#!/usr/bin/env bash
# The wheels scripts/device_check.sh installs on the device machine (issue 38), fetched here
# into .whl/ (in .gitignore; the device tool's `carry: [".whl"]` takes it along). The
# device image has JAX with CUDA, numpy, jinja2, werkzeug, click, h11, pyyaml, tqdm, pillow
# and pytest; it lacks kinetic's other dependencies and has no network.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl \
    gguf lark quart hypercorn cryptography cffi pycparser blinker itsdangerous flask \
    wsproto h2 hpack hyperframe priority aiofiles
du -sh .whl
