#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` and `llama-quantize` from the llama.cpp source that llama-cpp-python's
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
#
# Idempotent: when both binaries exist it only prints the path. Progress goes to stderr; stdout is the path.
set -euo pipefail

# The pinned version: its sdist vendors llama.cpp commit 0c1e570 (see .../<version>/LLAMA_CPP_COMMIT).
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
ROOT="${LLMPLAN_CACHE:-$HOME/.cache/llmplan}/llama.cpp/$VERSION"
BIN="$ROOT/bin"
JOBS="${JOBS:-2}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

die() { echo "build_llama_server.sh: $*" >&2; exit 1; }
say() { echo "build_llama_server.sh: $*" >&2; }

# BUILD_OK is written last, after both binaries are in place and start: a half-done build is redone.
if [[ -x "$BIN/llama-server" && -x "$BIN/llama-quantize" && -f "$ROOT/BUILD_OK" ]]; then
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
BUILD="$ROOT/build"

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
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
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
echo "GGML_NATIVE=ON ${EXTRA_FLAGS}" >"$ROOT/BUILD_FLAGS"

# 4. Configure. No network at build time: no CURL/OpenSSL (the server runs on loopback, models are local
#    files) and no web UI (its prebuilt assets would be downloaded); tests and examples are not needed.
say "configure: cmake (Release, GGML_NATIVE=ON) in $BUILD"
cmake -S "$LLAMA" -B "$BUILD" \
  -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON \
  -DCMAKE_C_FLAGS="$EXTRA_FLAGS" -DCMAKE_CXX_FLAGS="$EXTRA_FLAGS" \
  -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON >&2 \
  || die "configure: cmake failed for $LLAMA (see the output above)"

# 5. Build only the two targets.
say "build: llama-server llama-quantize with -j$JOBS (several minutes on 2 cores)"
cmake --build "$BUILD" --config Release --target llama-server llama-quantize -j "$JOBS" >&2 \
  || die "build: cmake --build failed (see the output above)"

mkdir -p "$BIN"
for target in llama-server llama-quantize; do
  found="$(find "$BUILD" -type f -name "$target" -perm -u+x | head -n 1)"
  [[ -n "$found" ]] || die "install: $target was not produced under $BUILD"
  cp "$found" "$BIN/$target"
done
"$BIN/llama-server" --version >"$ROOT/LLAMA_SERVER_VERSION" 2>&1 \
  || die "check: the built llama-server does not start ($BIN/llama-server --version)"
touch "$ROOT/BUILD_OK"
say "done: $(tr '\n' ' ' <"$ROOT/LLAMA_SERVER_VERSION")"
echo "$BIN/llama-server"
