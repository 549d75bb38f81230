#!/usr/bin/env bash
# Packs flash-attn-4 and NVIDIA's CuTe DSL (the "flash" attention backend) for a GPU machine without
# PyPI access that takes at most 64 MiB of files with each command. The CuTe compiler library alone is
# ~50 MB compressed, so it goes over with a command of its own (fa4a/), unpacked into /tmp/fa4site on the
# machine; the rest goes with the next command (fa4b/), where gpu_session.sh installs both:
#   bash scripts/pack_flash.sh
#   with fa4a/:          mkdir -p /tmp/fa4site && tar -xJf fa4a/ir.tar.xz -C /tmp/fa4site
#   with fa4b/ and .whl/:  bash scripts/gpu_session.sh <stages>
set -euo pipefail
cd "$(dirname "$0")/.."
FLASH=${FLASH:-flash-attn-4==4.0.0b36}
CUTE=${CUTE:-4.8.1}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform any -d "$work" "$@"
}
download "$FLASH" "nvidia-cutlass-dsl==$CUTE" "nvidia-cutlass-dsl-libs-base==$CUTE" \
  "nvidia-cutlass-dsl-libs-core==$CUTE" "nvidia-cutlass-dsl-libs-cu13==$CUTE" quack-kernels apache-tvm-ffi \
  torch-c-dlpack-ext
rm -rf fa4a fa4b && mkdir -p fa4a fa4b "$work/libs"
(cd "$work/libs" && python3 -m zipfile -e "$work"/nvidia_cutlass_dsl_libs_cu13-*.whl .)
compiler=nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so
tar -C "$work/libs" -cJf fa4a/ir.tar.xz "$compiler"
tar -C "$work/libs" --exclude "$compiler" -cJf fa4b/rest.tar.xz .
mv "$work"/*.whl fa4b/ && rm fa4b/nvidia_cutlass_dsl_libs_cu13-*.whl
du -sh fa4a fa4b
