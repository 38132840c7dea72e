"""Read a GGUF back and check it is what we meant to write.

Keys come from `gguf.Keys`, never magic strings. Checks:
- the file is complete: the header parses and every tensor's data lies inside
  the file (a truncated copy is named, not half-loaded);
- the pre-tokenizer is a known one (not llama.cpp's 'default' fallback), and HF
  and llama.cpp tokenize a probe set identically (special tokens, non-English);
- a chat template is embedded, and the prompt llama-cpp-python builds from it
  for a chat request has exactly the token ids of HF's `apply_chat_template`,
  for plain chats and, where the template renders tools, for a tool conversation
  (tool definitions, an assistant tool call, the tool's reply);
- generation stops where HF stops: the token that ends an assistant turn in the
  chat template, the model family's own end-of-turn token (families.py) and every
  HF end token (generation_config `eos_token_id`, tokenizer eos) are
  end-of-generation (EOG) tokens in the GGUF, the GGUF's eos is one of them, and
  no ordinary text token is EOG (a wrong EOS/EOT makes generation never stop, or
  stop mid-answer: unsloth #468) but those the family table names as llama.cpp's
  known quirk (Qwen3's '</s>'), which are reported;
- the family's llama.cpp constraints hold (Gemma 3: llama.cpp's fixed 5:1
  sliding/full layer pattern equals the config's layer_types, and its attention
  scale 1/sqrt(head_dim) equals HF's query_pre_attn_scalar**-0.5);
- Llama-3.1 rope scaling has `rope_freqs` (llama.cpp PR #8676), the tensor
  count matches the HF checkpoint;
- every 2-D weight really has the requested type. The converter silently keeps
  F16 for rows that are not a multiple of 32. For K-quants (block 256) llama.cpp
  falls back per tensor to a 32-block type (Q4_K -> Q5_0, Q5_K -> Q5_1,
  Q6_K -> Q8_0, Q2_K/Q3_K -> IQ4_NL) when a row length is not a multiple of 256,
  and to F16 when it is not a multiple of 32 either. The check demands: no 2-D
  weight left in a float type, and a K-quant type for every weight whose row
  length is a multiple of 256; the fallbacks are listed in the report (all
  tensors of a width-64 test model, none of Llama-3.1-8B).

The header is parsed here rather than with `gguf.GGUFReader`, which builds a
numpy view per array element and takes ~20 s on a 128k-token vocabulary.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import quiet
from .chat_template import CHAT_FORMAT, hf_end_tokens, in_form, tool_support
from .errors import UserError
from .families import llama_cpp_problems, of_config
from .quant_types import quant_type

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
PROBE_CHATS = [
    [{"role": "user", "content": "Repeat after me: red cat apple"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Größe? 日本語"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "  two  spaces\nand a newline  "}],
]
# A tool conversation as training renders it (data/formats.py): tool definitions, an assistant tool call with its
# arguments as an object and no content, the tool's reply. Compared as far as the template renders tools.
PROBE_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
PROBE_TOOL_CHAT = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"temp_c\": 21}"},
]
FLOAT_TYPES = {"F16", "F32", "BF16", "F64"}
K_BLOCK = 256


class GGUFCheckError(UserError, RuntimeError):
    pass


# --- a fast, complete-file-checking GGUF header reader ------------------------------------------

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_ARRAY_KEPT = 4096  # longer arrays (vocabulary, merges) are walked but not kept


@dataclass
class LongArray:
    """An array too long to keep (tokens, merges, scores): its item type and length."""
    item_type: int
    count: int


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: shape[0] is the row length (ne0)
    type_name: str
    offset: int  # from the start of the data section
    nbytes: int


@dataclass
class GGUFHeader:
    path: Path
    version: int
    fields: dict[str, Any]
    value_offsets: dict[str, int]  # file offset of each scalar value (tests patch metadata in place)
    tensors: list[TensorInfo]
    data_offset: int
    file_size: int
    notes: list[str] = field(default_factory=list)

    def get(self, key: str, default=None):
        return self.fields.get(key, default)


def read_header(path: Path) -> GGUFHeader:
    """Parse a GGUF's metadata and tensor table and verify every tensor's bytes are in the file.

    Raises GGUFCheckError naming the file for anything damaged or truncated."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            if size == 0:
                raise ValueError("empty file")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                hdr = _parse(buf, path, size)
    except GGUFCheckError:
        raise
    except (ValueError, struct.error, IndexError, OSError, UnicodeDecodeError, KeyError) as e:
        raise GGUFCheckError(f"{path}: not a readable GGUF ({type(e).__name__}: {e}). "
                             "The file may be truncated or not a GGUF.") from e
    # no tensors (a vocab-only GGUF): nothing follows the header, not even the data section's alignment padding
    end = max((hdr.data_offset + t.offset + t.nbytes for t in hdr.tensors), default=0)
    if end > size:
        short = [t.name for t in hdr.tensors if hdr.data_offset + t.offset + t.nbytes > size]
        raise GGUFCheckError(f"{path}: truncated: the tensor table needs {end:,} bytes but the file has {size:,} "
                             f"({len(short)} tensors incomplete, e.g. {short[:3]}). Re-copy or re-export it.")
    return hdr


def _parse(buf, path: Path, size: int) -> GGUFHeader:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, Keys

    pos = 0

    def take(fmt: str):
        nonlocal pos
        v = struct.unpack_from(fmt, buf, pos)[0]
        pos += struct.calcsize(fmt)
        return v

    def take_str() -> str:
        nonlocal pos
        n = take("<Q")
        if pos + n > size:
            raise ValueError(f"string of {n} bytes at offset {pos} runs past the end of the file")
        s = bytes(buf[pos:pos + n]).decode("utf-8")
        pos += n
        return s

    def skip_str() -> None:
        nonlocal pos
        n = struct.unpack_from("<Q", buf, pos)[0]
        pos += 8 + n
        if pos > size:
            raise ValueError("string runs past the end of the file")

    if bytes(buf[0:4]) != b"GGUF":
        raise ValueError(f"bad magic {bytes(buf[0:4])!r} (expected b'GGUF')")
    pos = 4
    version = take("<I")
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version}")
    n_tensors, n_kv = take("<Q"), take("<Q")
    fields: dict[str, Any] = {}
    offsets: dict[str, int] = {}
    for _ in range(n_kv):
        key = take_str()
        vtype = take("<I")
        if vtype in _SCALARS:
            offsets[key] = pos
            fields[key] = take(_SCALARS[vtype])
        elif vtype == _STRING:
            fields[key] = take_str()
        elif vtype == _ARRAY:
            itype, count = take("<I"), take("<Q")
            if itype in _SCALARS:
                width = struct.calcsize(_SCALARS[itype])
                if pos + width * count > size:
                    raise ValueError(f"array {key} runs past the end of the file")
                if count <= _MAX_ARRAY_KEPT:
                    fields[key] = [struct.unpack_from(_SCALARS[itype], buf, pos + i * width)[0] for i in range(count)]
                else:
                    fields[key] = LongArray(itype, count)
                pos += width * count
            elif itype == _STRING:
                if count <= _MAX_ARRAY_KEPT:
                    fields[key] = [take_str() for _ in range(count)]
                else:
                    for _ in range(count):
                        skip_str()
                    fields[key] = LongArray(itype, count)
            else:
                raise ValueError(f"unsupported array item type {itype} for {key}")
        else:
            raise ValueError(f"unknown value type {vtype} for {key}")
    tensors = []
    for _ in range(n_tensors):
        name = take_str()
        n_dims = take("<I")
        if n_dims > 8:
            raise ValueError(f"tensor {name} has {n_dims} dimensions")
        shape = tuple(take("<Q") for _ in range(n_dims))
        ttype = take("<I")
        offset = take("<Q")
        qt = GGMLQuantizationType(ttype)
        block, type_size = GGML_QUANT_SIZES[qt]
        n = 1
        for d in shape:
            n *= d
        tensors.append(TensorInfo(name, shape, qt.name, offset, n // block * type_size))
    align = fields.get(Keys.General.ALIGNMENT, 32)
    data_offset = (pos + align - 1) // align * align
    return GGUFHeader(path, version, fields, offsets, tensors, data_offset, size)


# --- checks -------------------------------------------------------------------------------------

def hf_tensor_count(model_dir: Path) -> int:
    from safetensors import safe_open

    n = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            n += len(list(st.keys()))
    return n


class _Captured(Exception):
    def __init__(self, prompt):
        self.prompt = prompt


def gguf_chat_prompt(llm, messages: list[dict], tools: list | None = None) -> list[int]:
    """The token ids llama-cpp-python would feed the model for a chat request (with `tools`, as the server passes
    them), built by the same handler `create_chat_completion` (and the server) use; works on a vocab-only Llama."""
    real = llm.__dict__.get("create_completion")

    def capture(prompt, *a, **k):
        raise _Captured(prompt)

    llm.create_completion = capture
    try:
        llm.create_chat_completion(messages=messages, tools=tools, max_tokens=1)
    except _Captured as c:
        prompt = c.prompt
    finally:
        if real is None:
            del llm.create_completion
        else:
            llm.create_completion = real
    return list(prompt) if not isinstance(prompt, str) else llm.tokenize(prompt.encode(), add_bos=True, special=True)


def tool_probe(tok) -> tuple[list, list | None, str]:
    """The part of PROBE_TOOL_CHAT the HF template renders (chat_template.tool_support's probes decide, as in
    training): (messages, in the form training gives the template, tools, what is compared); no messages when it
    renders none of it."""
    support, form = tool_support(tok)
    tools = PROBE_TOOLS if support["tools"] is None else None
    calls = support["tool calls"] is None and support["tool replies"] is None
    msgs = in_form(PROBE_TOOL_CHAT, form) if calls else (PROBE_TOOL_CHAT[:1] if tools else [])
    done = [f for f, ok in (("tools", tools), ("a tool call and its reply", calls)) if ok]
    missing = [f for f, why in support.items() if why is not None]
    what = " and ".join(done) or "none"
    return msgs, tools, what + (f" (the template does not render {', '.join(missing)})" if missing else "")


def tokenizer_parity(gguf: Path, model_dir: Path, texts=PROBE_TEXTS, chats=PROBE_CHATS) -> dict:
    """Token ids, chat prompts and end-of-generation tokens from HF and from llama.cpp (vocab only)."""
    import llama_cpp
    from gguf import Keys
    from transformers import AutoTokenizer

    family = of_config(Path(model_dir) / "config.json")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    has_template = bool(read_header(gguf).get(Keys.Tokenizer.CHAT_TEMPLATE))
    quiet.drop_llama_cpp_log(b"> n_ctx_train (0)")  # a vocab-only load has no training context to overflow
    llm = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False, chat_format=CHAT_FORMAT if has_template else None)
    try:
        mismatches = []
        for t in texts:
            hf = tok(t, add_special_tokens=False)["input_ids"]
            gg = llm.tokenize(t.encode(), add_bos=False, special=True)
            if hf != gg:
                mismatches.append({"text": t, "hf": hf[:20], "gguf": gg[:20]})
        chat_mismatches = []
        if tok.chat_template:
            for msgs in chats:
                hf = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"])
                gg = gguf_chat_prompt(llm, msgs)
                if hf != gg:
                    chat_mismatches.append({"messages": msgs, "hf": tok.decode(hf), "gguf": tok.decode(gg),
                                            "chat_format": llm.chat_format})
        tool_msgs, tools, tool_chat = tool_probe(tok) if tok.chat_template else ([], None, "nothing (no template)")
        if tool_msgs:
            hf = list(tok.apply_chat_template(tool_msgs, tools=tools, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])
            gg = gguf_chat_prompt(llm, tool_msgs, tools)
            if hf != gg:
                chat_mismatches.append({"messages": tool_msgs, "tools": tools, "hf": tok.decode(hf),
                                        "gguf": tok.decode(gg), "chat_format": llm.chat_format})
        vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
        n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        eog = [i for i in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)]
        ends = hf_end_tokens(tok, model_dir)
        special = set(tok.added_tokens_decoder)
        gguf_eos = llama_cpp.llama_vocab_eos(vocab)
        eot = tok.get_vocab().get(family.end_of_turn)  # None: this tokenizer's template uses another (SmolLM2)
        name = lambda i: tok.convert_ids_to_tokens(int(i)) if i is not None and 0 <= i < len(tok) else None  # noqa: E731
        res = {
            "mismatches": mismatches, "chat_mismatches": chat_mismatches, "chat_format": llm.chat_format,
            "tool_chat": tool_chat, "tool_chat_compared": bool(tool_msgs),
            "eog_ids": eog, "eog_tokens": [name(i) for i in eog], "hf_eos_ids": ends["eos_ids"],
            "turn_end_id": ends["turn_end_id"], "turn_end_token": name(ends["turn_end_id"]),
            "gguf_eos_id": gguf_eos, "gguf_eos_token": name(gguf_eos),
            "eog_not_special": [(i, name(i)) for i in eog if i not in special
                                and name(i) not in family.llama_cpp_eog_text],
            "eog_known_quirk": [(i, name(i)) for i in eog if i not in special and name(i) in family.llama_cpp_eog_text],
            "hf_ends_not_eog": [(i, name(i)) for i in ends["eos_ids"] if i not in eog],
            "family": family.name, "family_end_of_turn": family.end_of_turn, "eot_id": eot,
            "eot_is_eog": eot in eog if eot is not None else None,
        }
    finally:
        llm.close()
    return res


def _type_problems(hdr: GGUFHeader, qtype: str) -> tuple[list[str], list[str]]:
    """(weights of the wrong type, K-quant fallbacks) over the 2-D weights."""
    wanted = quant_type(qtype).tensor_type
    k_quant = qtype.endswith(("_k", "_k_s", "_k_m", "_k_l"))
    wrong, fallback = [], []
    for t in hdr.tensors:
        if len([d for d in t.shape if d > 1]) < 2:
            continue
        if wanted:
            if t.type_name != wanted:
                wrong.append(f"{t.name}:{t.type_name}")
        elif t.type_name in FLOAT_TYPES:
            wrong.append(f"{t.name}:{t.type_name}")
        elif k_quant and not t.type_name.endswith("_K"):
            (fallback if t.shape[0] % K_BLOCK else wrong).append(f"{t.name}:{t.type_name}")
    return wrong, fallback


def inspect_gguf(path: Path, model_dir: Path, qtype: str) -> dict:
    from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

    rope_freqs = f"{TENSOR_NAMES[MODEL_TENSOR.ROPE_FREQS]}.weight"

    path, model_dir, qtype = Path(path), Path(model_dir), qtype.lower()
    hdr = read_header(path)
    problems, notes = [], []
    pre = hdr.get(Keys.Tokenizer.PRE)
    if not pre or pre == "default":
        problems.append(f"{Keys.Tokenizer.PRE} is {pre!r}: the converter did not recognise the pre-tokenizer "
                        "(llama.cpp #8649), so tokenization would differ from HF.")
    template = hdr.get(Keys.Tokenizer.CHAT_TEMPLATE)
    if not template:
        problems.append(f"{Keys.Tokenizer.CHAT_TEMPLATE} is missing: servers would guess a chat format "
                        "(llama-cpp-python falls back to 'llama-2').")
    hf_cfg = json.loads((model_dir / "config.json").read_text())
    names = [t.name for t in hdr.tensors]
    rope = (hf_cfg.get("rope_scaling") or hf_cfg.get("rope_parameters") or {})
    if rope.get("rope_type") == "llama3" and rope_freqs not in names:
        problems.append(f"{rope_freqs} is missing although the model uses llama3 rope scaling (llama.cpp PR #8676).")
    expected_tensors = hf_tensor_count(model_dir) + (1 if rope_freqs in names else 0)
    if len(names) != expected_tensors:
        problems.append(f"{len(names)} tensors in the GGUF, expected {expected_tensors} from the HF checkpoint.")
    wrong, fallback = _type_problems(hdr, qtype)
    if wrong:
        want = quant_type(qtype).tensor_type or f"quantized ({qtype}: a K-quant wherever the row length is a multiple of 256)"
        problems.append(f"{len(wrong)} 2-D weights are not {want}: {wrong[:6]} (the converter keeps F16 for rows "
                        "that are not a multiple of 32; use model dimensions that are).")
    types: dict[str, int] = {}
    for t in hdr.tensors:
        types[t.type_name] = types.get(t.type_name, 0) + 1
    parity = tokenizer_parity(path, model_dir)
    if parity["mismatches"]:
        problems.append(f"HF and GGUF tokenize {len(parity['mismatches'])} probe texts differently, e.g. "
                        f"{parity['mismatches'][0]}")
    if template and parity["chat_mismatches"]:
        m = parity["chat_mismatches"][0]
        problems.append(f"the chat prompt llama-cpp-python builds (format {m['chat_format']!r}) differs from HF's "
                        f"apply_chat_template on {len(parity['chat_mismatches'])} probe chats"
                        f"{' (the tool conversation among them)' if any('tools' in x for x in parity['chat_mismatches']) else ''}, e.g. "
                        f"HF {m['hf']!r} vs GGUF {m['gguf']!r}")
    if parity["turn_end_id"] is not None and parity["turn_end_id"] not in parity["eog_ids"]:
        problems.append(f"the chat template ends assistant turns with {parity['turn_end_token']!r} (id "
                        f"{parity['turn_end_id']}), which is not an end-of-generation token in the GGUF: generation "
                        f"would never stop (unsloth #468). GGUF EOG tokens: {parity['eog_tokens']}")
    if parity["hf_ends_not_eog"]:  # a warning: only the turn end and the GGUF's own eos decide chat answers
        notes.append(f"HF also stops at {parity['hf_ends_not_eog']} (generation_config eos), which the GGUF does "
                     "not treat as end-of-generation")
    if parity["gguf_eos_id"] not in parity["hf_eos_ids"]:
        problems.append(f"the GGUF's eos token is {parity['gguf_eos_token']!r} (id {parity['gguf_eos_id']}), not one "
                        f"of HF's end tokens {parity['hf_eos_ids']}: servers use it as the stop string.")
    if parity["eog_not_special"]:
        problems.append(f"ordinary text tokens are end-of-generation in the GGUF: {parity['eog_not_special'][:5]}; "
                        "answers would stop mid-sentence.")
    if parity["eot_is_eog"] is False:
        problems.append(f"the {parity['family']} end-of-turn token {parity['family_end_of_turn']!r} (id "
                        f"{parity['eot_id']}) is not end-of-generation in the GGUF: generation would not stop there.")
    if parity["eog_known_quirk"]:
        notes.append(f"llama.cpp ends generation at {parity['eog_known_quirk']} by its spelling, an ordinary "
                     f"{parity['family']} token (a typed '</s>' in a prompt becomes it): a known llama.cpp quirk, "
                     "docs/training.md#model-families")
    problems += llama_cpp_problems(of_config(hf_cfg), hf_cfg)
    if problems:
        raise GGUFCheckError(f"{path} failed its checks:\n- " + "\n- ".join(problems))
    report = {
        "architecture": hdr.get(Keys.General.ARCHITECTURE),
        "file_type": hdr.get(Keys.General.FILE_TYPE),
        "pre_tokenizer": pre, "chat_template": True, "chat_format": parity["chat_format"],
        "chat_prompts_identical": len(PROBE_CHATS) + parity["tool_chat_compared"],
        "tool_chat": parity["tool_chat"], "tensors": len(names), "tensor_types": types,
        "k_quant_fallbacks": fallback, "rope_freqs": rope_freqs in names,
        "probe_texts_identical": len(PROBE_TEXTS), "eog_tokens": parity["eog_tokens"],
        "eos_token": parity["gguf_eos_token"], "turn_end_token": parity["turn_end_token"],
        "family": parity["family"], "family_end_of_turn": parity["family_end_of_turn"],
        "eot_is_eog": parity["eot_is_eog"], "eog_known_quirk": parity["eog_known_quirk"],
        "bytes": hdr.file_size, "notes": notes,
    }
    fb = f"; {len(fallback)} K-quant fallbacks (row length not a multiple of {K_BLOCK})" if fallback else ""
    report["summary"] = (f"pre-tokenizer {pre}, {len(PROBE_TEXTS)}/{len(PROBE_TEXTS)} probe texts and "
                         f"{report['chat_prompts_identical']} chat prompts (tool conversation: "
                         f"{parity['tool_chat']}) tokenize identically, "
                         f"{parity['turn_end_token']} ends generation, "
                         f"{len(names)} tensors ({', '.join(f'{k} {v}' for k, v in sorted(types.items()))}){fb}")
    for n in notes:
        print(f"quantize: note: {n}", flush=True)
    return report


def chat_template_of(path: Path) -> str | None:
    from gguf import Keys

    return read_header(path).get(Keys.Tokenizer.CHAT_TEMPLATE) or None


# --- llama.cpp runtime guard ---------------------------------------------------------------------
