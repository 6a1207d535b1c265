#!/usr/bin/env bash
# Builds llama.cpp's `llama-server`, `llama-quantize`, `llama-bench` and `llama-batched-bench` from the llama.cpp source that llama-cpp-python's
# source distribution vendors (vendor/llama.cpp), so the baseline of `llmplan bench --serve` is one pinned,
# reproducible llama.cpp that any machine with PyPI access can rebuild. A benchmark dependency, not a test one.
#
#   benchmarks/build_llama_server.sh            # prints the path of llama-server (builds it the first time)
#
# Environment:
#   LLAMA_CPP_PYTHON_VERSION  the llama-cpp-python sdist to take llama.cpp from (default: the pin below)
#   LLMPLAN_CACHE             cache root (default ~/.cache/llmplan); binaries go to
#                             $LLMPLAN_CACHE/llama.cpp/<version>/bin, the source stays in .../src
#   PYTHON                    the Python whose pip downloads the sdist (default: .venv/bin/python, else python3)
#   JOBS                      parallel compile jobs (default 2: the machine's cores are shared)
#   LLAMA_CPU                 native (default): GGML_NATIVE=ON, for this CPU; avx2: AVX2+FMA+F16C only (no
#                             AVX-512), the reference for llmplan's forced AVX2 path (LLMPLAN_ISA=avx2). The
#                             avx2 build goes to .../build-avx2 and .../bin-avx2.
#
# Idempotent: when both binaries exist it only prints the path. Progress goes to stderr; stdout is the path.
set -euo pipefail

# The pinned version: its sdist vendors llama.cpp commit 0c1e570 (see .../<version>/LLAMA_CPP_COMMIT).
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
ROOT="${LLMPLAN_CACHE:-$HOME/.cache/llmplan}/llama.cpp/$VERSION"
CPU="${LLAMA_CPU:-native}"
case "$CPU" in
  native) SUFFIX="" ;;
  avx2) SUFFIX="-avx2" ;;
  *) echo "build_llama_server.sh: LLAMA_CPU must be native or avx2 (got '$CPU')" >&2; exit 1 ;;
esac
BIN="$ROOT/bin$SUFFIX"
TARGETS=(llama-server llama-quantize llama-bench llama-batched-bench)
JOBS="${JOBS:-2}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

die() { echo "build_llama_server.sh: $*" >&2; exit 1; }
say() { echo "build_llama_server.sh: $*" >&2; }

# BUILD_OK is written last, after the binaries are in place and start: a half-done build is redone.
built=1
for target in "${TARGETS[@]}"; do [[ -x "$BIN/$target" ]] || built=0; done
if [[ $built == 1 && -f "$ROOT/BUILD_OK$SUFFIX" ]]; then
  echo "$BIN/llama-server"
  exit 0
fi

if [[ -n "${PYTHON:-}" ]]; then :
elif [[ -x "$HERE/../.venv/bin/python" ]]; then PYTHON="$HERE/../.venv/bin/python"
else PYTHON=python3
fi

# Fail on a missing tool before spending minutes on the download.
for tool in cmake cc c++ make tar; do
  command -v "$tool" >/dev/null || die "check tools: '$tool' not found (Debian: apt-get install cmake build-essential)"
done
"$PYTHON" -m pip --version >/dev/null 2>&1 || die "check tools: '$PYTHON -m pip' does not run (set PYTHON)"

mkdir -p "$ROOT"
SDIST_DIR="$ROOT/sdist"
SRC="$ROOT/src"
BUILD="$ROOT/build$SUFFIX"

# 1. Download the source distribution (--no-binary: we want its vendored llama.cpp tree, not a built binding;
#    pip prepares the sdist's metadata in an isolated build env, so this step takes a minute or two).
if ! compgen -G "$SDIST_DIR/llama_cpp_python-$VERSION.tar.gz" >/dev/null; then
  say "download: llama-cpp-python==$VERSION source distribution"
  mkdir -p "$SDIST_DIR"
  "$PYTHON" -m pip download -q --no-deps --no-binary :all: \
    "llama-cpp-python==$VERSION" -d "$SDIST_DIR" >&2 \
    || die "download: pip download llama-cpp-python==$VERSION failed"
fi
SDIST="$SDIST_DIR/llama_cpp_python-$VERSION.tar.gz"
[[ -f "$SDIST" ]] || die "download: $SDIST not found after pip download"

# 2. Extract it whole: vendor/llama.cpp's .git points into the sdist's .git/modules, which is how llama.cpp's
#    build-info (and `llama-server --version`) learns the commit.
LLAMA="$SRC/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [[ ! -f "$LLAMA/CMakeLists.txt" ]]; then
  say "extract: $SDIST"
  rm -rf "$SRC" && mkdir -p "$SRC"
  tar -xzf "$SDIST" -C "$SRC" || die "extract: tar failed on $SDIST"
  [[ -f "$LLAMA/CMakeLists.txt" ]] || die "extract: no vendor/llama.cpp/CMakeLists.txt in $SDIST"
fi
COMMIT_FILE="$SRC/llama_cpp_python-$VERSION/.git/modules/vendor/llama.cpp/HEAD"
if [[ -f "$COMMIT_FILE" ]]; then cp "$COMMIT_FILE" "$ROOT/LLAMA_CPP_COMMIT"; fi

# 3. GGML_NATIVE=ON compiles for -march=native, which turns on ggml's AMX matmul wherever cpuid lists amx_*.
#    Some VMs list AMX but fault on its first instruction (llama-server then dies with SIGSEGV/SIGILL in
#    ggml_backend_amx_mul_mat on its warm-up): run one tile instruction, and build without AMX if it fails.
EXTRA_FLAGS=""
if [[ "$CPU" == native ]] && grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
  PROBE_DIR="$(mktemp -d)"
  cat >"$PROBE_DIR/amx.c" <<'EOF'
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    unsigned char cfg[64] __attribute__((aligned(64)));
    if (syscall(SYS_arch_prctl, 0x1023, 18)) return 2; /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA */
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1; cfg[16] = 64; cfg[48] = 16; /* palette 1, tile 0: 16 rows of 64 bytes */
    _tile_loadconfig(cfg);
    _tile_zero(0);
    _tile_release();
    return 0;
}
EOF
  # The subshell keeps bash's "Illegal instruction" notice about the probe off the terminal.
  if cc -O1 -mamx-tile -o "$PROBE_DIR/amx" "$PROBE_DIR/amx.c" 2>/dev/null && ("$PROBE_DIR/amx") 2>/dev/null; then
    say "probe: AMX works here; ggml may use it"
  else
    EXTRA_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # GCC: explicit -mno-* win over -march=native
    say "probe: cpuid lists AMX but a tile instruction fails in this process; building with $EXTRA_FLAGS"
  fi
  rm -rf "$PROBE_DIR"
fi
if [[ "$CPU" == native ]]; then
  ISA_FLAGS=(-DGGML_NATIVE=ON)
else  # x86-64 with AVX2/FMA/F16C/BMI2 and nothing wider: what an AVX2-only CPU (e.g. Zen 3) runs
  ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
             -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF)
fi
echo "${ISA_FLAGS[*]} ${EXTRA_FLAGS}" >"$ROOT/BUILD_FLAGS$SUFFIX"

# 4. Configure. No network at build time: no CURL/OpenSSL (the server runs on loopback, models are local
#    files) and no web UI (its prebuilt assets would be downloaded); tests and examples are not needed.
say "configure: cmake (Release, ${ISA_FLAGS[*]}) in $BUILD"
cmake -S "$LLAMA" -B "$BUILD" \
  -DCMAKE_BUILD_TYPE=Release \
  "${ISA_FLAGS[@]}" \
  -DCMAKE_C_FLAGS="$EXTRA_FLAGS" -DCMAKE_CXX_FLAGS="$EXTRA_FLAGS" \
  -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON >&2 \
  || die "configure: cmake failed for $LLAMA (see the output above)"

# 5. Build only these targets (the server for --serve; llama-bench and llama-batched-bench for --vs llama.cpp).
say "build: ${TARGETS[*]} with -j$JOBS (several minutes on 2 cores)"
cmake --build "$BUILD" --config Release --target "${TARGETS[@]}" -j "$JOBS" >&2 \
  || die "build: cmake --build failed (see the output above)"

mkdir -p "$BIN"
for target in "${TARGETS[@]}"; do
  found="$(find "$BUILD" -type f -name "$target" -perm -u+x | head -n 1)"
  [[ -n "$found" ]] || die "install: $target was not produced under $BUILD"
  cp "$found" "$BIN/.$target.tmp" && mv -f "$BIN/.$target.tmp" "$BIN/$target"  # a running copy keeps its inode
done
"$BIN/llama-server" --version >"$ROOT/LLAMA_SERVER_VERSION$SUFFIX" 2>&1 \
  || die "check: the built llama-server does not start ($BIN/llama-server --version)"
touch "$ROOT/BUILD_OK$SUFFIX"
say "done: $(tr '\n' ' ' <"$ROOT/LLAMA_SERVER_VERSION$SUFFIX")"
echo "$BIN/llama-server"
