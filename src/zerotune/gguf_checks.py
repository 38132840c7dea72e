"""Read a GGUF back and check it is what we meant to write.

Keys come from `gguf.Keys`, never magic strings. Checks: the pre-tokenizer is a
known one (not llama.cpp's 'default' fallback), HF and llama.cpp tokenize a
probe set identically (special tokens and non-English text included), a chat
template is embedded, `<|eot_id|>` is an end-of-generation token (else
generation never stops, unsloth #468), Llama-3.1 rope scaling has `rope_freqs`
(llama.cpp PR #8676), the tensor count matches the HF checkpoint, and every
2-D weight really has the requested type (the converter silently keeps F16 for
rows that are not a multiple of the block size).
"""

from __future__ import annotations

import json
from pathlib import Path

PROBE_TEXTS = [
    "Hello world! How are you today?",
    "Repeat after me: red cat apple",
    "Größenwahn, café, naïve façade — déjà vu.",
    "日本語のテキストと中文文本。",
    "Привет, как дела? 12345 + 67890 = 80235",
    "    indented code:\n\tdef f(x):\n\t\treturn x ** 2\n",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
    "emoji 🤖🚀 and symbols ∑∫√",
]
END_OF_TURN = "<|eot_id|>"
QUANT_NAMES = {"q8_0": "Q8_0", "f16": "F16", "bf16": "BF16", "f32": "F32"}


class GGUFCheckError(RuntimeError):
    pass


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    return f.contents()


def hf_tensor_count(model_dir: Path) -> int:
    from safetensors import safe_open

    n = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            n += len(list(st.keys()))
    return n


def tokenizer_parity(gguf: Path, model_dir: Path, texts=PROBE_TEXTS) -> dict:
    """Token ids from HF and from llama.cpp (vocab only) on the probe texts."""
    import llama_cpp
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    llm = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False)
    try:
        mismatches = []
        for t in texts:
            hf = tok(t, add_special_tokens=False)["input_ids"]
            gg = llm.tokenize(t.encode(), add_bos=False, special=True)
            if hf != gg:
                mismatches.append({"text": t, "hf": hf[:20], "gguf": gg[:20]})
        eot = tok.convert_tokens_to_ids(END_OF_TURN)
        vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
        eot_is_eog = bool(llama_cpp.llama_vocab_is_eog(vocab, eot)) if eot is not None else False
    finally:
        llm.close()
    return {"mismatches": mismatches, "eot_id": eot, "eot_is_eog": eot_is_eog}


def inspect_gguf(path: Path, model_dir: Path, qtype: str) -> dict:
    from gguf import GGMLQuantizationType, GGUFReader, Keys

    path, model_dir = Path(path), Path(model_dir)
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # the reader raises bare ValueErrors/struct errors on a damaged file
        raise GGUFCheckError(f"{path}: not a readable GGUF ({type(e).__name__}: {e}). The file may be truncated.") from e
    problems = []
    pre = _field(reader, Keys.Tokenizer.PRE)
    if not pre or pre == "default":
        problems.append(f"{Keys.Tokenizer.PRE} is {pre!r}: the converter did not recognise the pre-tokenizer "
                        "(llama.cpp #8649), so tokenization would differ from HF.")
    template = _field(reader, Keys.Tokenizer.CHAT_TEMPLATE)
    if not template:
        problems.append(f"{Keys.Tokenizer.CHAT_TEMPLATE} is missing: servers would guess a chat format.")
    hf_cfg = json.loads((model_dir / "config.json").read_text())
    names = [t.name for t in reader.tensors]
    rope = (hf_cfg.get("rope_scaling") or hf_cfg.get("rope_parameters") or {})
    if rope.get("rope_type") == "llama3" and "rope_freqs.weight" not in names:
        problems.append("rope_freqs.weight is missing although the model uses llama3 rope scaling (llama.cpp PR #8676).")
    expected_tensors = hf_tensor_count(model_dir) + (1 if "rope_freqs.weight" in names else 0)
    if len(names) != expected_tensors:
        problems.append(f"{len(names)} tensors in the GGUF, expected {expected_tensors} from the HF checkpoint.")
    wanted = QUANT_NAMES.get(qtype)
    wrong = []
    types: dict[str, int] = {}
    for t in reader.tensors:
        tname = GGMLQuantizationType(t.tensor_type).name
        types[tname] = types.get(tname, 0) + 1
        is_matrix = len([d for d in t.shape if d > 1]) >= 2
        if not is_matrix:
            continue
        if wanted and tname != wanted:
            wrong.append(f"{t.name}:{tname}")
        if not wanted and tname in ("F16", "F32", "BF16"):
            wrong.append(f"{t.name}:{tname}")
    if wrong:
        problems.append(f"{len(wrong)} 2-D weights are not {wanted or 'quantized'}: {wrong[:6]} (rows not a multiple "
                        "of the block size are kept in F16 by the converter).")
    parity = tokenizer_parity(path, model_dir)
    if parity["mismatches"]:
        problems.append(f"HF and GGUF tokenize {len(parity['mismatches'])} probe texts differently, e.g. "
                        f"{parity['mismatches'][0]}")
    if not parity["eot_is_eog"]:
        problems.append(f"{END_OF_TURN} (id {parity['eot_id']}) is not an end-of-generation token in the GGUF: "
                        "generation would never stop (unsloth #468).")
    if problems:
        raise GGUFCheckError(f"{path} failed its checks:\n- " + "\n- ".join(problems))
    report = {
        "architecture": _field(reader, Keys.General.ARCHITECTURE),
        "file_type": _field(reader, Keys.General.FILE_TYPE),
        "pre_tokenizer": pre, "chat_template": True, "tensors": len(names), "tensor_types": types,
        "rope_freqs": "rope_freqs.weight" in names, "probe_texts_identical": len(PROBE_TEXTS),
        "eot_is_eog": True,
    }
    report["summary"] = (f"pre-tokenizer {pre}, {len(PROBE_TEXTS)}/{len(PROBE_TEXTS)} probe texts tokenize "
                         f"identically, chat template embedded, {END_OF_TURN} ends generation, "
                         f"{len(names)} tensors ({', '.join(f'{k} {v}' for k, v in sorted(types.items()))})")
    return report
