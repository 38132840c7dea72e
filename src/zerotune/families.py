"""Model families: everything zerotune must know about an architecture, in one table.

A model is recognised by its config.json (`model_type`, `architectures`); anything not in FAMILIES is refused
before a weight is loaded, with the list of what is supported (`of_config`). Every model-specific decision
reads this table:

- train/worker.py: the Liger patch (`apply_liger`), applied to the classes before the model is built;
- adapters.py, planner/memory.py: the linears LoRA may target (`lora_targets`);
- planner/memory.py: the activation terms (q/k norms, Gemma 3's four fp32 norms per layer, sliding-window
  layers), derived from the config (tests/test_activation_memory.py measures each family);
- hardware.choose: the precisions a family may train in on a GPU (`Family.precision_refusal`): Gemma 3 in fp16 is
  refused, with the reason and the sources, before anything loads;
- data/tokenize.py, answering.py, gguf_checks.py: chat-template quirks (Qwen3's thinking block, Gemma's system
  prompt folded into the first user turn), the family's end-of-turn token, what llama.cpp does differently.

Versions this table was checked against: transformers 5.23, liger-kernel 0.8.5, peft 0.21.2, llama.cpp as
vendored in llama-cpp-python 0.3.36 (assets/llama.cpp, its converter; the runtime's C++ in the same sdist).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UserError, why_unreadable

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS = REPO_ROOT / "configs" / "models"

# The decoder linears of all three families (transformers 5.23 modeling_{llama,qwen3,gemma3}.py: q/k/v/o_proj in
# the attention, gate/up/down_proj in the MLP); lm_head and the embeddings are not targets (modules_to_save).
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class UnknownArchitectureError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]      # config.json model_type values of this family
    architectures: tuple[str, ...]    # the causal-LM class transformers builds from them
    gguf_arch: str                    # general.architecture written by llama.cpp's converter
    liger: str                        # liger_kernel.transformers function (0.8.5 monkey_patch.py)
    liger_kernels: dict               # its keyword arguments: which kernels replace which modules
    lora_targets: tuple[str, ...]     # linears LoRA may target
    mlp: str                          # "swiglu" (silu(gate) * up) or "geglu" (gelu_tanh(gate) * up)
    qk_norm: bool                     # RMSNorm over head_dim on q and k before RoPE
    norm: str                         # "llama": w * x_hat.to(dtype); "gemma": (x_hat * (1 + w)).to(dtype), in fp32
    norms_per_layer: int              # 2 (pre-attention, pre-MLP); Gemma 3: 4 (+ after attention, after the MLP)
    embed_scale: bool                 # Gemma: embeddings x sqrt(hidden)
    tied: str                         # where the tie comes from
    end_of_turn: str                  # the token the family's own chat template ends an assistant turn with
    template: str                     # chat-template quirks, and where zerotune handles them
    fp16: str | None                  # None: fp16 training allowed (with DeepSpeed's loss scaling); else why refused
    fp16_note: str                    # what is known about this family in fp16, with sources
    llama_cpp: str                    # what llama.cpp (the runtime version) does differently, and how it is checked
    weights_licence: str              # licence of the released weights (the tokenizer in assets/ belongs to them)
    public_configs: dict = field(default_factory=dict)  # hub-name regex -> shipped public config (planning offline)
    thinking: tuple[str, str] | None = None  # (open, close) of a reasoning block the template may render
    # text tokens llama.cpp's vocab loader makes end-of-generation by their spelling alone (see llama_cpp)
    llama_cpp_eog_text: tuple[str, ...] = ()
    # llama.cpp's fixed sliding/full pattern (every n-th layer full) when the GGUF carries none (see llama_cpp)
    llama_cpp_swa_pattern: int | None = None

    def liger_function(self):
        import liger_kernel.transformers as lk

        return getattr(lk, self.liger)

    def check_lora_targets(self, targets) -> None:
        """peft.target_modules must name linears of this family (lora_targets), or be ['all-linear']: peft would
        otherwise fail deep in get_peft_model, or adapt a module the planner does not count."""
        targets = list(targets)
        unknown = [t for t in targets if t not in self.lora_targets]
        if targets != ["all-linear"] and unknown:
            raise UserError(f"peft.target_modules {unknown}: not a linear of a {self.name} model. Use any of "
                            f"{list(self.lora_targets)}, or ['all-linear'].")

    def precision_refusal(self, precision: str) -> str | None:
        """Why this family may not train in `precision` (None: it may). Hardware limits (bf16 below sm80, fp16 on
        a CPU) are hardware.choose's; this is the model's own. A method, so hardware.py asks a family it is handed
        without importing this table."""
        return self.fp16 if precision == "fp16" else None


FAMILIES: dict[str, Family] = {
    "llama": Family(
        name="llama", model_types=("llama",), architectures=("LlamaForCausalLM",), gguf_arch="llama",
        liger="apply_liger_kernel_to_llama",
        liger_kernels=dict(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True, cross_entropy=False),
        lora_targets=_LINEARS, mlp="swiglu", qk_norm=False, norm="llama", norms_per_layer=2, embed_scale=False,
        tied="config tie_word_embeddings (Llama-3.1-8B: untied; SmolLM2, Llama-3.2-1B: tied)",
        end_of_turn="<|eot_id|>",
        template="Llama 3.1: a dated default system header; SmolLM2 (same architecture) uses ChatML (<|im_end|>): the "
                 "turn end is read from the tokenizer's template, not assumed",
        fp16=None,
        fp16_note="allowed with DeepSpeed's dynamic loss scaling; reported fp16 overflows (transformers #27179, "
                  "#27121; trl #1173 on V100) stop the run at the first non-finite loss (safety.py)",
        llama_cpp="Llama-3.1's llama3 rope scaling needs rope_freqs (llama.cpp PR #8676): gguf_checks checks it",
        weights_licence="Llama 3.1 Community License (Meta); SmolLM2: Apache-2.0",
        public_configs={r"^(meta-llama/)?(Meta-)?Llama-3\.1-8B": CONFIGS / "llama31_8b.json"}),
    "qwen3": Family(
        name="qwen3", model_types=("qwen3",), architectures=("Qwen3ForCausalLM",), gguf_arch="qwen3",
        liger="apply_liger_kernel_to_qwen3",
        liger_kernels=dict(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True, cross_entropy=False),
        lora_targets=_LINEARS, mlp="swiglu", qk_norm=True, norm="llama", norms_per_layer=2, embed_scale=False,
        tied="config tie_word_embeddings (Qwen3-0.6B/1.7B/4B: tied; Qwen3-8B and larger: untied)",
        end_of_turn="<|im_end|>",
        template="ChatML with a thinking block: the last assistant turn after the last user query renders as "
                 "'<think>\\n\\n</think>\\n\\n' + answer, earlier turns without it; the generation prompt adds the "
                 "empty block only with enable_thinking=False, which llama-cpp-python's template renderer never "
                 "passes. zerotune trains the template as shipped (thinking on): the last turn's labels include "
                 "the empty block, so the model learns to skip thinking and HF and the GGUF see the same prompt "
                 "(data/tokenize.py locates earlier turns in their history form); answers are scored after the "
                 "block (answer_text). Renders tools, tool calls and tool replies, but reads the content of every "
                 "assistant turn: a tool-call turn gets content '' (OpenAI's null fails it; data/tokenize.py "
                 "CALL_FORMS)",
        fp16=None,
        fp16_note="allowed with loss scaling; Qwen's maintainers: trained in bf16, fp16 may overflow, use bf16 or "
                  "fp32 if inf/NaN appear (QwenLM/Qwen3 #670, #868, both on V100); unsloth-zoo PR #866 found the "
                  "fp16 backward of QK-norm models (qwen3_moe) overflowing at step 1. The run stops at the first "
                  "non-finite loss and DeepSpeed skips non-finite steps (safety.py): it cannot run on silently",
        llama_cpp="llama.cpp's vocab makes every token spelled '</s>' end-of-generation and control "
                  "(src/llama-vocab.cpp:2901, added for PaddleOCR); in Qwen3's vocabulary it is an ordinary BPE "
                  "token (id 128247) that HF never produces for the text '</s>' (it splits it into 3 tokens), but "
                  "llama.cpp maps a typed '</s>' in a prompt to it. gguf_checks reports it as this known quirk; "
                  "any other text token that is end-of-generation still fails the check",
        weights_licence="Apache-2.0 (Qwen3 dense models, e.g. Qwen/Qwen3-8B)",
        public_configs={r"^(Qwen/)?Qwen3-8B(-Base)?$": CONFIGS / "qwen3_8b.json"},
        thinking=("<think>", "</think>"), llama_cpp_eog_text=("</s>",)),
    "gemma3": Family(
        name="gemma3", model_types=("gemma3_text",), architectures=("Gemma3ForCausalLM",), gguf_arch="gemma3",
        liger="apply_liger_kernel_to_gemma3_text",
        liger_kernels=dict(rope=True, rms_norm=True, geglu=True, fused_linear_cross_entropy=True, cross_entropy=False),
        lora_targets=_LINEARS, mlp="geglu", qk_norm=True, norm="gemma", norms_per_layer=4, embed_scale=True,
        tied="always (Gemma3ForCausalLM._tied_weights_keys: lm_head is embed_tokens)",
        end_of_turn="<end_of_turn>",
        template="no system role: the template folds a system message into the first user turn (system text + "
                 "'\\n\\n' + user text, unlabelled) and raises on roles that do not alternate user/assistant (a "
                 "bad row, named); renders no tools or tool calls and has no tool role (such rows are refused, "
                 "saying so); the template writes <bos> itself",
        fp16="Gemma 3 overflows in fp16: activations exceed fp16's 65,504 (unsloth: up to ~800k in gemma3_text, "
             "unsloth PR #4014; 'gradients and activations become infinity' on T4/V100, unsloth.ai/blog/gemma3); "
             "transformers #36822 (fp16 output empty, NaN activations), its clamping fixes #36831/#36832 were "
             "closed unmerged and transformers 5.23's Gemma3RMSNorm still casts (x * (1 + w)) to fp16 unclamped "
             "(models/gemma3/modeling_gemma3.py:144-149); #39972 (open) reports the same NaN at inference. Loss "
             "scaling cannot help: it scales gradients, not a forward activation above the fp16 range",
        fp16_note="refused in fp16; bf16 (sm80+) or fp32",
        llama_cpp="llama.cpp assumes Gemma 3's 5:1 sliding/full layer pattern (src/models/gemma3.cpp:7, "
                  "load_swa_pattern(ml, 6)); the converter writes no layer pattern, so a config whose layer_types "
                  "differ would be served with other attention: refused at quantize (gguf_checks). The npm "
                  "tokenizer has no tokenizer.model, so the converter takes the tokenizer.json path: its "
                  "pre-tokenizer hash is 'granite-embed-multi-311m' (conversion/base.py:1927-1929), which llama.cpp "
                  "treats as Gemma 4's BPE with escaped whitespace (src/llama-vocab.cpp:2232-2235); token ids are "
                  "checked identical to HF's",
        weights_licence="Gemma Terms of Use (Google), with its Prohibited Use Policy: not an open-source licence",
        public_configs={r"^(google/)?gemma-3-12b(-it|-pt)?$": CONFIGS / "gemma3_12b.json"},
        llama_cpp_swa_pattern=6),
}


def supported() -> str:
    return ", ".join(f"{f.name} ({'/'.join(f.model_types)}: {'/'.join(f.architectures)})" for f in FAMILIES.values())


def by_model_type(model_type: str | None, architectures=None, where: str = "the model's config.json") -> Family:
    """The family of a config's model_type; an unknown one is one message listing what zerotune supports."""
    for f in FAMILIES.values():
        if model_type in f.model_types:
            archs = [a for a in (architectures or []) if a not in f.architectures]
            if archs:
                raise UnknownArchitectureError(
                    f"{where}: architectures {archs} (model_type {model_type!r}) is not a causal LM zerotune trains. "
                    f"Supported: {supported()}.")
            return f
    hint = (" Gemma 3's multimodal config (model_type 'gemma3', Gemma3ForConditionalGeneration) is not supported: "
            "use the text model's config (text_config, model_type 'gemma3_text', Gemma3ForCausalLM)."
            if model_type == "gemma3" else "")
    archs = ", ".join(architectures or []) or "no architectures"
    raise UnknownArchitectureError(f"{where}: model_type {model_type!r} ({archs}) is not a model family zerotune "
                                   f"knows. Supported: {supported()}.{hint}")


def of_config(config) -> Family:
    """The family of a config: a config.json path, a folder holding one, a dict, or a transformers config."""
    if isinstance(config, (str, Path)):
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        try:
            data, where = json.loads(path.read_text()), str(path)
        except (OSError, ValueError) as e:
            raise UserError(f"{path}: not a readable model config.json ({why_unreadable(e)}): point "
                            f"model.init_config (or model.name_or_path) at a transformers config, e.g. "
                            f"configs/models/tiny_llama31.json.") from None
        if not isinstance(data, dict):
            raise UserError(f"{path}: a model config.json holds a JSON object, not {type(data).__name__}: point "
                            f"model.init_config (or model.name_or_path) at a transformers config.")
    elif isinstance(config, dict):
        data, where = config, "the model's config"
    else:
        data, where = config.to_dict(), "the model's config"
    return by_model_type(data.get("model_type"), data.get("architectures"), where)


def public_config(name: str) -> Path | None:
    """The shipped public config for a hub model name (planning without a download), or None."""
    for f in FAMILIES.values():
        for pattern, path in f.public_configs.items():
            if re.match(pattern, name or "", re.IGNORECASE):
                return path
    return None


# ---- precision -----------------------------------------------------------------------------------

def precisions(family: Family, gpu) -> dict[str, str | None]:
    """{precision: None if this family trains in it on this GPU, else why not}: the capability table per GPU."""
    out = {}
    for p in ("bf16", "fp16", "fp32"):
        if p == "bf16" and not gpu.bf16:
            out[p] = f"{gpu.name} has no bf16"
        elif p == "fp16" and gpu.capability is None:
            out[p] = "fp16 mixed precision needs a CUDA GPU"
        else:
            out[p] = family.precision_refusal(p)
    return out


# ---- runtime: Liger, answers -------------------------------------------------------------------

def apply_liger(family: Family) -> None:
    """Patch the family's transformers classes with Liger's kernels, before the model is instantiated: the fused
    linear cross entropy then runs inside <Family>ForCausalLM.forward, where ZeRO-3 has gathered lm_head (trl
    #3368, Liger #1048)."""
    family.liger_function()(**family.liger_kernels)


def answer_text(family: Family | None, text: str) -> str:
    """The answer a scorer should see: a leading reasoning block (Qwen3's '<think>...</think>') removed, as a
    client of the model would. Text without one is returned unchanged."""
    if family is None or family.thinking is None:
        return text
    open_, close = family.thinking
    s = text.lstrip()
    if s.startswith(open_) and close in s:
        return s.split(close, 1)[1].strip()
    return text


def base_template_kwargs(family: Family | None) -> dict:
    """Chat-template arguments for the *base* model's answers (check and eval's base column, data.replay): a
    family that reasons by default (Qwen3) is asked not to, as its makers document for direct answers, so its
    answer fits the token budget and is the answer, not the start of a reasoning block. The fine-tuned model
    and the GGUF keep the template as shipped: that is how they were trained and how they are served."""
    return {"enable_thinking": False} if family is not None and family.thinking is not None else {}


def llama_cpp_problems(family: Family, hf_config: dict) -> list[str]:
    """Where llama.cpp would compute something else than HF for this config ([]: nowhere we know of)."""
    out = []
    n, types = family.llama_cpp_swa_pattern, hf_config.get("layer_types")
    if n is not None and types:
        # layer il slides iff il % n < n - 1 (src/llama-hparams.cpp:14-16, set_swa_pattern) unless the GGUF says
        # otherwise, and the converter writes no pattern for Gemma 3
        theirs = ["sliding_attention" if il % n < n - 1 else "full_attention" for il in range(len(types))]
        if list(types) != theirs:
            out.append(f"the model's layer_types {types} differ from the pattern llama.cpp assumes for {family.name} "
                       f"(every {n}th layer full: {theirs}); the GGUF would attend differently from HF. Use the "
                       f"family's own pattern (sliding_window_pattern {n}) in the config.")
    if family.name == "gemma3" and hf_config.get("num_hidden_layers") != 62:
        # llama.cpp scales Gemma 3's attention by 1/sqrt(head_dim) except for the 27B (62 layers), whatever
        # query_pre_attn_scalar says (src/models/gemma3.cpp:28-31); HF uses query_pre_attn_scalar**-0.5
        q, d = hf_config.get("query_pre_attn_scalar"), hf_config.get("head_dim")
        if q is not None and q != d:
            out.append(f"query_pre_attn_scalar {q} != head_dim {d}: llama.cpp scales attention by 1/sqrt(head_dim) "
                       "(src/models/gemma3.cpp:28-31), HF by query_pre_attn_scalar**-0.5: the GGUF would differ.")
    return out


def table_rows(gpus: dict) -> list[dict]:
    """The family table as rows (docs, tests): one per family, precisions per GPU."""
    rows = []
    for f in FAMILIES.values():
        rows.append({"family": f.name, "model_type": "/".join(f.model_types), "liger": f.liger,
                     "lora_targets": list(f.lora_targets), "tied": f.tied, "end_of_turn": f.end_of_turn,
                     "precisions": {g: [p for p, why in precisions(f, gpu).items() if why is None]
                                    for g, gpu in gpus.items()}})
    return rows
