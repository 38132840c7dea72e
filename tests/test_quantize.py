"""GGUF export: llama.cpp's converter/quantizer output is read back, and broken files are caught."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from zerotune.gguf_checks import (
    PROBE_TEXTS,
    GGUFCheckError,
    LongArray,
    inspect_gguf,
    read_header,
    tokenizer_parity,
)

pytestmark = pytest.mark.integration


def _recipe(out: Path, qtype: str):
    from zerotune.config import load_recipe

    return load_recipe("tiny", [f"output_dir={out}", f"quantize.type={qtype}"])


def test_real_q8_0_passes_and_every_matrix_is_q8_0(tiny_gguf, tiny_model_dir):
    report = inspect_gguf(tiny_gguf, tiny_model_dir, "q8_0")
    hdr = read_header(tiny_gguf)
    matrices = [t for t in hdr.tensors if len([d for d in t.shape if d > 1]) >= 2]
    assert matrices and all(t.type_name == "Q8_0" for t in matrices)
    assert report["tensor_types"]["Q8_0"] == len(matrices)
    assert report["pre_tokenizer"] == "llama-bpe" and report["rope_freqs"]
    assert report["turn_end_token"] == "<|eot_id|>" and "<|eot_id|>" in report["eog_tokens"]
    assert report["chat_format"] == "chat_template.default"
    assert isinstance(hdr.get("tokenizer.ggml.tokens"), LongArray) and hdr.get("tokenizer.ggml.tokens").count == 128256


def test_hf_and_gguf_token_ids_identical(tiny_gguf, tiny_model_dir):
    parity = tokenizer_parity(tiny_gguf, tiny_model_dir)
    assert parity["mismatches"] == [] and parity["chat_mismatches"] == []
    # the shipped Llama-3.1 tokenizer's template is Llama-3's plain one: no tool conversation to compare
    assert not parity["tool_chat_compared"] and parity["tool_chat"].startswith("none (the template does not render")
    assert parity["eot_is_eog"] and parity["gguf_eos_token"] == "<|eot_id|>"
    assert parity["eog_not_special"] == []
    assert len(PROBE_TEXTS) >= 8


@pytest.mark.parametrize("keep", [0.5, 0.0005])  # tensor data cut, and header cut
def test_truncated_file_is_caught(tiny_gguf, tiny_model_dir, tmp_path, keep):
    bad = tmp_path / "truncated.gguf"
    data = tiny_gguf.read_bytes()
    bad.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(GGUFCheckError, match="truncated") as e:
        inspect_gguf(bad, tiny_model_dir, "q8_0")
    assert str(bad) in str(e.value)


def test_wrong_eos_is_caught(tiny_gguf, tiny_model_dir, tmp_path, tokenizer):
    """eos pointing at an ordinary word: llama.cpp makes it end-of-generation, answers would stop mid-sentence."""
    hello = tokenizer.convert_tokens_to_ids("Hello")
    bad = tmp_path / "wrong-eos.gguf"
    shutil.copyfile(tiny_gguf, bad)
    off = read_header(bad).value_offsets["tokenizer.ggml.eos_token_id"]
    with open(bad, "r+b") as f:
        f.seek(off)
        f.write(struct.pack("<I", hello))
    assert read_header(bad).get("tokenizer.ggml.eos_token_id") == hello
    with pytest.raises(GGUFCheckError) as e:
        inspect_gguf(bad, tiny_model_dir, "q8_0")
    msg = str(e.value)
    assert "eos token is 'Hello'" in msg and "ordinary text tokens are end-of-generation" in msg


def test_gguf_that_would_never_stop_is_caught(tiny_gguf, tiny_model_dir, tmp_path):
    """A fine-tune whose chat template ends turns with a token the GGUF does not treat as end-of-generation."""
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    tpl = model / "chat_template.jinja"
    tpl.write_text(tpl.read_text().replace("<|eot_id|>", "<|reserved_special_token_5|>"))
    gen = json.loads((model / "generation_config.json").read_text())
    gen["eos_token_id"] = [128001, 128013]
    (model / "generation_config.json").write_text(json.dumps(gen))
    with pytest.raises(GGUFCheckError, match="would never stop"):
        inspect_gguf(tiny_gguf, model, "q8_0")


def _odd_model(dst: Path, tokenizer_dir: Path) -> Path:
    """Hidden size 80: rows of 80 are not a multiple of Q8_0's 32-block, so the converter keeps F16."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=80, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=20, vocab_size=128256, max_position_embeddings=2048,
                      rope_theta=500000.0, bos_token_id=128000, eos_token_id=[128001, 128009],
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(dst)
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(dst)
    return dst


def test_dimension_not_multiple_of_32_caught_and_earlier_gguf_kept(tiny_gguf, tokenizer_dir, tmp_path):
    from zerotune.layout import layout
    from zerotune.quantize import quantize

    r = _recipe(tmp_path / "run", "q8_0")
    _odd_model(r.out / "model", tokenizer_dir)
    earlier = layout(r).gguf
    earlier.parent.mkdir(parents=True)
    shutil.copyfile(tiny_gguf, earlier)  # a good GGUF from an earlier run
    before = earlier.read_bytes()
    with pytest.raises(GGUFCheckError, match=r"not Q8_0.*F16"):
        quantize(r)
    assert earlier.read_bytes() == before
    assert sorted(p.name for p in earlier.parent.iterdir()) == [earlier.name]  # no partial or temp files


def test_quantize_k_quant_end_to_end(tiny_model_dir, tmp_path):
    """q4_k_m through llama.cpp's quantizer. Every tiny row (64/128) is shorter than a 256 K-block, so
    llama.cpp falls back per tensor to 32-block types: accepted, and listed as fallbacks in the report."""
    from zerotune import manifest as mf
    from zerotune.layout import layout
    from zerotune.quantize import quantize

    r = _recipe(tmp_path / "run", "q4_k_m")
    shutil.copytree(tiny_model_dir, r.out / "model")
    m = quantize(r)
    out = layout(r).gguf
    assert out.exists() and m["sha256"] == mf.sha256(out) and m["bytes"] == out.stat().st_size
    assert mf.read(out.parent / "manifest.json")["sha256"] == m["sha256"]
    hdr = read_header(out)
    matrices = [t for t in hdr.tensors if len([d for d in t.shape if d > 1]) >= 2]
    assert all(t.type_name not in ("F16", "F32", "BF16") for t in matrices)
    assert len(m["checks"]["k_quant_fallbacks"]) == len(matrices)  # none of the rows is a 256-multiple
    assert sorted(p.name for p in out.parent.iterdir()) == sorted([out.name, "manifest.json", "recipe.resolved.yaml"])


# Llama-3-style headers with tools, tool calls (as {"name", "parameters"} JSON) and tool replies (ipython turns):
# the shape of Llama-3.1-Instruct's own template, which the shipped tokenizer lacks
LLAMA_TOOLS_TEMPLATE = """\
{{- bos_token }}
{%- if tools %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\nYou may call these functions:\\n' }}
{%- for t in tools %}{{- (t | tojson) + '\\n' }}{%- endfor %}
{{- '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
{{- '<|start_header_id|>' + ('ipython' if message.role == 'tool' else message.role) + '<|end_header_id|>\\n\\n' }}
{%- if message.tool_calls is defined %}
{%- for call in message.tool_calls %}{{- {'name': call.function.name, 'parameters': call.function.arguments} | tojson }}{%- endfor %}
{%- else %}{{- message.content | trim }}{%- endif %}
{{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""


def test_tool_conversation_token_ids_identical_and_a_difference_caught(tiny_model_dir, tmp_path):
    """A template that renders tools: llama-cpp-python's prompt for a tool conversation (tools, an assistant tool
    call, the tool's reply) must have HF's token ids. A vocab-only GGUF carries the template; then HF's template is
    changed in the tool call alone, and the check must see it."""
    import subprocess
    import sys

    from zerotune.gguf_checks import PROBE_TOOL_CHAT
    from zerotune.quantize import CONVERTER

    model = shutil.copytree(tiny_model_dir, tmp_path / "model", ignore=shutil.ignore_patterns("*.safetensors"))
    (model / "chat_template.jinja").write_text(LLAMA_TOOLS_TEMPLATE)
    gguf = tmp_path / "vocab.gguf"
    subprocess.run([sys.executable, str(CONVERTER), str(model), "--vocab-only", "--outfile", str(gguf)], check=True,
                   capture_output=True)
    parity = tokenizer_parity(gguf, model)
    assert parity["tool_chat_compared"] and parity["tool_chat"] == "tools and a tool call and its reply"
    assert parity["chat_mismatches"] == [] and parity["mismatches"] == []

    (model / "chat_template.jinja").write_text(LLAMA_TOOLS_TEMPLATE.replace("'parameters'", "'arguments'"))
    parity = tokenizer_parity(gguf, model)
    assert [m["messages"] for m in parity["chat_mismatches"]] == [PROBE_TOOL_CHAT]
    assert '"parameters": {"city": "Paris"}' in parity["chat_mismatches"][0]["gguf"]
