"""Known harmless third-party output, silenced at its source, one entry at a time.

Each entry names the logger or warning it drops (by message, never by level alone) and why it is
harmless here; anything not listed still reaches the log. `silence_known_noise()` runs at the start
of every zerotune process (cli.main), before the libraries are imported.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import warnings

# (logger name, text the message contains, why it is harmless)
LOG_LINES = [
    ("DeepSpeed", "Setting accelerator to CPU.",
     "printed by every process that imports deepspeed on a machine without a GPU; zerotune detects the "
     "hardware itself and says what it chose"),
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-community",
     "an optional kernel from the hub; bitsandbytes uses its built-in CPU path. Logged at import (peft imports "
     "bitsandbytes) and only on CPUs with AVX512-BF16, so a machine without them never shows it"),
    ("transformers.tokenization_utils_tokenizers", "Ignoring clean_up_tokenization_spaces=True for BPE tokenizer",
     "Llama-3's tokenizer_config.json asks for it; transformers rightly skips it for a BPE tokenizer"),
]

# (message regex, category, module regex of the caller the warning is attributed to, why)
WARNINGS = [
    (r"`torch\.distributed\.all_gather_into_tensor` is deprecated", FutureWarning, r"torch\.distributed\.c10d_logger",
     "DeepSpeed 0.19 calls this torch API on every ZeRO-3 parameter gather: hundreds of identical lines per run"),
    (r"`(gradient_checkpointing_enable|is_gradient_checkpointing)` is deprecated", FutureWarning,
     r"transformers\.modeling_utils", "peft (QLoRA's prepare_model_for_kbit_training) still calls the old names"),
    (r"OMP_NUM_THREADS/MKL_NUM_THREADS unset, we set it at", UserWarning, r"accelerate\.state",
     "one CPU process (QLoRA): accelerate picks one thread per physical core, as intended"),
]


class _Drop(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def drop_log(logger: str, text: str) -> None:
    """Drop one message of one logger (a filter on the logger: records it emits itself, not its children's)."""
    log = logging.getLogger(logger)
    if not any(isinstance(f, _Drop) and f.text == text for f in log.filters):
        log.addFilter(_Drop(text))


def silence_known_noise() -> None:
    for logger, text, _why in LOG_LINES:
        drop_log(logger, text)
    for message, category, module, _why in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    if not sys.stderr.isatty():
        # transformers' and the hub's progress bars (e.g. "Writing model shards") are carriage-return
        # animations: in a log file they are one garbled line per save. zerotune's own bars follow the same rule.
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        # datasets' own bars ("Generating test split: 60 examples", lm-evaluation-harness loading its task in
        # `zerotune eval`): read once, when datasets is imported
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


@contextlib.contextmanager
def drop_stdout_lines(prefix: str):
    """Run a block with stdout captured, then print every captured line except those starting with `prefix`
    (for libraries that print() instead of logging)."""
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            yield
    finally:
        kept = [x for x in buf.getvalue().splitlines(keepends=True) if not x.startswith(prefix)]
        if kept:
            sys.stdout.write("".join(kept))
            sys.stdout.flush()


_LLAMA_CPP_DROPPED: list[bytes] = []
_LLAMA_CPP_CALLBACK = []  # a ctypes callback must outlive its registration


def drop_llama_cpp_log(text: bytes) -> None:
    """Drop llama.cpp log lines containing `text`, keep the rest. llama-cpp-python's verbose=False does not
    hide llama.cpp's warnings: its level table predates ggml's (WARN is 3 now, which it reads as ERROR)."""
    import ctypes

    import llama_cpp
    from llama_cpp import _logger

    if text not in _LLAMA_CPP_DROPPED:
        _LLAMA_CPP_DROPPED.append(text)
    if _LLAMA_CPP_CALLBACK:
        return

    @llama_cpp.llama_log_callback
    def callback(level, message, user_data):
        if not any(t in message for t in _LLAMA_CPP_DROPPED):
            _logger.llama_log_callback(level, message, user_data)

    _LLAMA_CPP_CALLBACK.append(callback)
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
