"""The recipe schema: one typed source of truth for every stage.

A recipe is a YAML file in `recipes/`. Every field is declared here once, with
its type, default, valid values and a one-line help text (`zerotune explain` prints them),
and so is every rule between fields. How a field is declared and a section read (unknown
keys refused with a suggestion, values coerced to the declared type) is recipe_fields.py's.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from .format_table import FORMATS, ROLE_TARGETS, tool_definitions
from .hardware import GPUS
from .quant_types import QUANT_TYPES
from .recipe_fields import (AT_LEAST_1, FRACTION, FRACTION_BELOW_1, GPU_LAYERS, NON_NEGATIVE, POSITIVE, Bound,
                            RecipeError, build, coerce, help_of, read_yaml, suggest)
from .recipe_fields import setting as _f  # short: every field of the schema below is one
from .scorers import SCORERS

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPES_DIR = REPO_ROOT / "recipes"


@dataclass
class ModelCfg:
    name_or_path: Optional[str] = _f(None, "HF model id or local folder with pretrained weights; null = random init from init_config")
    init_config: Optional[str] = _f(None, "Path to a transformers config.json to initialise a model from scratch (tiny recipes)")
    tokenizer: str = _f("assets/tokenizer/llama3_1", "Tokenizer folder or id (needs a chat template for chat data)")
    init_seed: int = _f(1234, "Seed for random initialisation from init_config")


# One table of data formats: format_table.py
FormatName = Literal[tuple(FORMATS)]
_MESSAGE_FORMATS = ", ".join(f.name for f in FORMATS.values() if f.message_keys)  # rows that hold a message list


@dataclass
class SourceCfg:
    path: str = _f("", "Local file (.jsonl/.json/.parquet/.csv) or hub dataset id")
    format: FormatName = _f("messages", "Row format (docs/data.md): " + "; ".join(f"{f.name} = {f.what}" for f in FORMATS.values()))
    weight: float = _f(1.0, "Mixture weight: fraction of this source's rows to use (>1 repeats rows)", POSITIVE)
    split: str = _f("train", "Split, for hub datasets")
    name: Optional[str] = _f(None, "Config name, for hub datasets")
    revision: Optional[str] = _f(None, "Revision, for hub datasets")
    columns: dict = _f({}, "Your names for our fields, per format (row fields, and message keys role/content for " + _MESSAGE_FORMATS + "), e.g. {messages: conversations, role: from, content: value}")
    roles: dict = _f({}, "Formats " + _MESSAGE_FORMATS + ": your role names -> ours (" + ", ".join(ROLE_TARGETS) + "; tool_call = an assistant tool call), over ShareGPT's usual names for format sharegpt, e.g. {bot: assistant}")
    tools: Optional[list] = _f(None, "Chat formats: tool definitions ([{type: function, function: {name, description, parameters}}]) rendered into every conversation of this source that has no 'tools' of its own; null = rows' own only")


@dataclass
class ReplayCfg:
    path: str = _f("", "JSONL of general chat prompts ({messages: [...]}, ending with a user turn), disjoint from every eval set; the base model answers each once")
    ratio: float = _f(0.2, "Replay conversations as a fraction of all training documents (0.2 = one in five); prompts repeat when the set is smaller", Bound(0, 1, lo_open=True, hi_open=True))
    max_new_tokens: int = _f(128, "Greedy tokens per answer; an answer cut off at this length is trained without its end-of-turn token", AT_LEAST_1)
    limit: Optional[int] = _f(None, "Answer only the first N prompts; null = all", AT_LEAST_1)


@dataclass
class DataCfg:
    sources: list = _f([], "List of sources (see SourceCfg)")
    heldout: Optional[str] = _f(None, "JSONL of held-out chat prompts with reference answers, scored exact by check and eval: the short form of one eval set (set one of the two, not both)")
    seq_len: int = _f(2048, "Tokens per packed sequence (or max length unpacked)", AT_LEAST_1)
    packing: bool = _f(True, "Pack documents into seq_len bins (best-fit decreasing); False = one row per document, length-grouped batches padded per batch")
    loss_on: Literal["all_assistant", "last_assistant"] = _f("all_assistant", "Which assistant turns carry loss")
    overlong: Literal["truncate", "drop"] = _f("truncate", "What to do with samples longer than seq_len")
    on_bad_sample: Literal["error", "skip"] = _f("error", "Stop at a malformed row, or skip it and count it in the manifest")
    num_proc: int = _f(1, "Processes for tokenization", AT_LEAST_1)
    eval_fraction: float = _f(0.0, "Fraction of rows held out as validation documents", FRACTION_BELOW_1)
    seed: int = _f(0, "Shuffle/mixture seed")
    replay: Optional[ReplayCfg] = _f(None, "Self-distilled replay: the base model's own greedy answers to general prompts, mixed into training so the fine-tune keeps its behaviour off-task (see ReplayCfg); null = off")


@dataclass
class TrainCfg:
    global_batch_tokens: int = _f(65536, "Tokens per optimizer step (all ranks, all accumulation steps); GA is derived from it", AT_LEAST_1)
    micro_batch_size: int = _f(1, "Sequences per rank per forward pass", AT_LEAST_1)
    epochs: float = _f(1.0, "Passes over the prepared data", POSITIVE)
    max_steps: int = _f(-1, "Optimizer steps; overrides epochs when > 0")
    lr: float = _f(2e-5, "Peak learning rate", POSITIVE)
    min_lr_ratio: float = _f(0.1, "Final LR as a fraction of peak (cosine)", FRACTION)
    warmup_ratio: float = _f(0.03, "Fraction of steps spent warming up", FRACTION_BELOW_1)
    weight_decay: float = _f(0.0, "AdamW weight decay", NON_NEGATIVE)
    adam_beta2: float = _f(0.95, "AdamW beta2", FRACTION_BELOW_1)
    max_grad_norm: float = _f(1.0, "Gradient clipping", NON_NEGATIVE)
    precision: Literal["auto", "fp32", "fp16", "bf16"] = _f("auto", "auto = bf16 on sm80+, fp16 on V100/T4, fp32 on CPU")
    attention: Literal["auto", "sdpa_docs", "sdpa", "eager", "flash_attention_2"] = _f("auto", "auto = flash_attention_2 on sm80+ when installed, else sdpa_docs (SDPA per document of a packed row, no S x S mask); sdpa = SDPA with transformers' dense block-causal mask")
    liger: Literal["auto", "on", "off"] = _f("auto", "Liger kernels: auto = on with a CUDA GPU, off on CPU")
    gradient_checkpointing: bool = _f(True, "Recompute activations in backward (True = less memory)")
    deepspeed: Optional[str] = _f("configs/deepspeed/zero3.json", "DeepSpeed JSON (Trainer-owned values stay 'auto'); null = no DeepSpeed")
    zero: dict = _f({}, "Overrides merged into zero_optimization (memory knobs, offload)")
    seed: int = _f(42, "Training seed")
    logging_steps: int = _f(1, "Log every N optimizer steps", AT_LEAST_1)
    eval_steps: int = _f(0, "Validation loss (+ eval.samples answers) every N optimizer steps; 0 = only at the end. Needs data.eval_fraction > 0", NON_NEGATIVE)
    save_steps: int = _f(0, "Checkpoint every N optimizer steps (0 = only at the end)", NON_NEGATIVE)
    save_total_limit: int = _f(2, "Committed checkpoints to keep; 0 = all", NON_NEGATIVE)
    report_to: Literal["none", "wandb"] = _f("none", "Experiment tracker (wandb runs offline without an API key)")
    cpu_procs: int = _f(2, "Processes to launch when no GPU is visible (CPU runs only)", AT_LEAST_1)
    sequence_parallel: int = _f(1, "GPUs that share one row (DeepSpeed Ulysses): each holds seq_len / N of its tokens (inside attention: every token, heads / N of the heads); data parallelism is world / N. 1 = off; N divides the GPUs of a node and the attention heads (docs/training.md#long-rows-sequence-parallelism)", AT_LEAST_1)


@dataclass
class PeftCfg:
    method: Literal["none", "lora", "qlora"] = _f("none", "none = full fine-tuning; lora = low-rank adapters on a 16-bit base (works with ZeRO-3); qlora = adapters on a 4-bit NF4 base (bitsandbytes, no DeepSpeed)")
    r: int = _f(16, "LoRA rank", AT_LEAST_1)
    alpha: float = _f(32.0, "LoRA alpha (the update is scaled by alpha / r)", POSITIVE)
    dropout: float = _f(0.05, "LoRA dropout", FRACTION_BELOW_1)
    target_modules: list = _f(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                              "Module names that get adapters ('all-linear' as the single entry = every linear layer but lm_head)")
    modules_to_save: list = _f([], "Modules trained in full beside the adapters and saved with them, e.g. [embed_tokens, lm_head]")
    optim: str = _f("auto", "Trainer optimizer when peft is on: auto = adamw_torch; e.g. paged_adamw_8bit for QLoRA on a GPU (bitsandbytes)")
    merge_atol: float = _f(1e-3, "Max |logit diff| allowed between the merged model and base + adapter when publishing (fp32 merge)", POSITIVE)


# DPO's loss variants: the formulas of liger-kernel's LigerFusedLinearDPOFunction.preference_loss_fn (preference/loss.py)
# that need no per-row token counts ("ipo" does; Liger refuses it)
PREFERENCE_LOSSES = ("sigmoid", "hinge", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "apo_zero",
                     "apo_down", "discopop")


@dataclass
class PreferenceCfg:
    method: Literal["none", "dpo"] = _f("none", "none = supervised fine-tuning on chat data; dpo = Direct Preference Optimization on chosen/rejected pairs (pair formats, docs/training.md#preference-tuning-dpo)")
    beta: float = _f(0.1, "DPO's beta: how far the policy may move from the reference (the starting model); the reward of a completion is beta x (log pi - log pi_ref)", POSITIVE)
    loss: Literal[PREFERENCE_LOSSES] = _f("sigmoid", "DPO loss variant (liger-kernel's formulas): " + ", ".join(PREFERENCE_LOSSES) + "; sigmoid = the DPO paper's -log sigmoid(beta x margin)")
    label_smoothing: float = _f(0.0, "loss robust: the assumed fraction of flipped preference labels, in [0, 0.5); exo_pair: its epsilon, > 0")
    nll_alpha: float = _f(0.0, "Weight of the chosen completions' mean token NLL added to the DPO loss (RPO; TRL's rpo_alpha, Liger's alpha): keeps DPO from lowering the likelihood of what chosen and rejected share; 0 = plain DPO", NON_NEGATIVE)
    chunk_tokens: int = _f(1024, "Completion tokens whose vocabulary-wide logits are alive at once in the fused DPO loss (memory: chunk x vocab x ~12 B)", AT_LEAST_1)


# GRPO's loss normalisations that split exactly over micro-batches and ranks (rl/loss.py): grpo = each completion's
# token mean, then the mean over completions; dr_grpo = the sum over tokens / (completions x max_new_tokens). Liger's
# bnpo/dapo divide by the step's completion tokens, known only after every rollout of the step.
GRPO_LOSSES = ("grpo", "dr_grpo")


@dataclass
class RlCfg:
    method: Literal["none", "grpo"] = _f("none", "none = no reinforcement learning; grpo = Group Relative Policy Optimization with verifiable rewards: the model answers each training prompt group_size times and learns from each answer's reward against its group's (docs/training.md#rl-with-verifiable-rewards-grpo)")
    group_size: int = _f(8, "Completions sampled per prompt (G); each is one row of the micro-batch: micro_batch_size prompts x G rows", Bound(2, None))
    reward: str = _f("exact", "What scores a completion against its prompt's reference (the last assistant turn of the training row): a scorer (" + ", ".join(SCORERS) + "), or your function by dotted path, e.g. my_rewards.score (module on PYTHONPATH or the repo root): f(completion: str, row: dict) -> float, row = {messages, answer}")
    reward_timeout_s: float = _f(10.0, "Seconds one reward call may take; past it the call is stopped and counted as an error", POSITIVE)
    on_reward_error: Literal["stop", "skip"] = _f("stop", "A reward that raises, times out or returns a non-number: stop = the run stops with one line naming the function and the prompt; skip = the prompt's group is left out of the step (no gradient from it) and counted in the log")
    scale_rewards: bool = _f(True, "Advantages = (reward - group mean) / (group std + 1e-4), as GRPO; false = reward - group mean, Dr. GRPO's unbiased estimate")
    loss: Literal[GRPO_LOSSES] = _f("grpo", "Token normalisation: grpo = each completion's mean over its tokens, then the mean over completions; dr_grpo = the sum over all tokens / (completions x max_new_tokens) (Dr. GRPO: no length bias)")
    beta: float = _f(0.0, "Weight of the KL to the starting model (k3 estimator per token, added to each completion token's loss); > 0 runs the starting model on every micro-batch's rollouts: with LoRA the base with the adapters off, else a frozen copy on every GPU (`make plan` says whether it fits); 0 = none", NON_NEGATIVE)
    epsilon: float = _f(0.2, "Clip range of the ratio to the rollout policy: [1 - epsilon, 1 + epsilon]", POSITIVE)
    max_new_tokens: int = _f(64, "Longest completion a rollout samples; the prompt and its completion must fit in data.seq_len", AT_LEAST_1)
    temperature: float = _f(1.0, "Sampling temperature of the rollouts; the policy's log-probs are of the same tempered distribution", POSITIVE)
    top_p: float = _f(1.0, "Nucleus sampling of the rollouts (1 = off)", Bound(0, 1, lo_open=True))
    chunk_tokens: int = _f(1024, "Completion tokens whose vocabulary-wide logits are alive at once in the fused GRPO loss", AT_LEAST_1)


QuantName = Literal[tuple(QUANT_TYPES)]  # one list of types: the table in quant_types.py


@dataclass
class QuantizeCfg:
    type: QuantName = _f("q8_0", "GGUF type: " + ", ".join(QUANT_TYPES) + " (f32/f16/bf16/q8_0 from llama.cpp's converter, the rest through its quantizer)")


@dataclass
class CheckCfg:
    max_new_tokens: int = _f(32, "Greedy tokens per held-out prompt", AT_LEAST_1)
    accuracy_margin: float = _f(0.02, "GGUF score may trail the HF score on each held-out set by at most this (or one answer of the set, whichever is larger)", FRACTION)
    max_kl: Optional[float] = _f(None, "Max mean KL(HF||GGUF) nats/token; null = default for the quant type", NON_NEGATIVE)
    min_top1: Optional[float] = _f(None, "Min top-1 agreement; null = default for the quant type", FRACTION)
    n_ctx: int = _f(8192, "Context length for the T4 fit report", AT_LEAST_1)
    n_kl_texts: int = _f(16, "Held-out documents used for KL / top-1 / perplexity", AT_LEAST_1)
    n_gpu_layers: int = _f(0, "Layers llama.cpp offloads to the GPU during check (-1 = all, e.g. on a T4)", GPU_LAYERS)


# One list of scorer names: the table in scorers.py.
ScorerName = Literal[tuple(SCORERS)]


@dataclass
class EvalSetCfg:
    name: str = _f("", "Short name shown in tables (e.g. task, retention)")
    path: str = _f("", "JSONL of {messages: [chat prompt], answer: reference} rows (+ optional per-row pattern)")
    scorer: ScorerName = _f("exact", "How an answer is compared with the reference: " + ", ".join(SCORERS))
    pattern: Optional[str] = _f(None, "scorer regex: group 1 is the extracted answer (a row's own pattern wins)")
    max_new_tokens: int = _f(32, "Greedy tokens per prompt", AT_LEAST_1)
    max_drop: Optional[float] = _f(None, "Fine-tuned HF may score at most this much below the base model (check enforces it); null = no gate", FRACTION)
    forbid: Optional[str] = _f(None, "Sets after the first: a regex (re.search) marking an answer as leaked; replaces the leak test of the first set's scorer (json_valid/json_fields: the answer is JSON); null = that test")
    max_leakage: Optional[float] = _f(None, "Sets after the first: fine-tuned HF and GGUF may answer at most this fraction in the task's format (check and eval enforce it); null = no gate", FRACTION)
    limit: Optional[int] = _f(None, "Score only the first N rows; null = all", AT_LEAST_1)


@dataclass
class EvalCfg:
    sets: list = _f([], "Held-out sets scored by check and `zerotune eval` (base vs fine-tuned HF vs GGUF), see EvalSetCfg; empty = data.heldout scored exact (set one of the two, not both)")
    samples: int = _f(4, "Held-out prompts (first set) answered greedily at each in-training evaluation; 0 = none", NON_NEGATIVE)
    batch_size: int = _f(8, "Prompts the HF models answer per generate() call in check, eval and data.replay (left-padded; the same greedy answers as one at a time)", AT_LEAST_1)
    lm_eval_tasks: list = _f([], "lm-evaluation-harness tasks run by `zerotune eval`; zerotune_heldout = the local task built from the first set")
    lm_eval_limit: Optional[int] = _f(None, "lm-eval: examples per task; null = all", AT_LEAST_1)
    pairs: Optional[dict] = _f(None, "Held-out preference pairs scored by eval and check (a source: path, format, columns, roles): preference accuracy of the starting and the tuned model, the tuned model's reward accuracy and margin over the start; null = none")


@dataclass
class ServeCfg:
    host: str = _f("127.0.0.1", "Bind address (loopback by default)")
    port: int = _f(8000, "Port", Bound(1, 65535))
    n_ctx: int = _f(4096, "Context length", AT_LEAST_1)
    n_gpu_layers: int = _f(0, "Layers offloaded to GPU (-1 = all)", GPU_LAYERS)
    api_key: Optional[str] = _f(None, "Require this bearer token (better: ZEROTUNE_API_KEY in the environment)")
    max_request_kb: int = _f(1024, "Largest request body in KiB; a larger one gets 413", AT_LEAST_1)
    max_tokens: int = _f(1024, "Most tokens one answer may ask for (more is a 400); a chat request without max_tokens gets this many at most", AT_LEAST_1)
    max_queue: int = _f(16, "Requests that may wait while the model answers another (it answers one at a time); more get 429 with Retry-After", NON_NEGATIVE)


GPUName = Literal[tuple(GPUS)]  # one table of GPUs: hardware.py


@dataclass
class PlanCfg:
    gpu: GPUName = _f("cpu", "Target accelerator for the plan and dry-run: " + ", ".join(GPUS))
    gpus_per_node: int = _f(2, "Processes (GPUs) per node on the target cluster", AT_LEAST_1)
    nodes: int = _f(1, "Nodes on the target cluster", AT_LEAST_1)
    cpu_ram_gb: float = _f(24, "CPU RAM per node, GB", POSITIVE)
    mfu: Optional[float] = _f(None, "Assumed efficiency of the compute kernels alone: executed FLOPs (recompute and masked attention included) / peak; not the training log's MFU (6N + causal attention, no recompute); null = default for the GPU", Bound(0, 1, lo_open=True))


@dataclass
class Recipe:
    name: str = _f("", "Recipe name (file stem)")
    output_dir: str = _f("", "Where stage outputs go; default runs/<name>")
    model: ModelCfg = _f(None, "Model")
    data: DataCfg = _f(None, "Data preparation")
    train: TrainCfg = _f(None, "Training")
    peft: PeftCfg = _f(None, "Parameter-efficient fine-tuning (LoRA / QLoRA); merged into runs/<name>/model after training")
    preference: PreferenceCfg = _f(None, "Preference tuning (DPO) on chosen/rejected pairs instead of supervised fine-tuning")
    rl: RlCfg = _f(None, "Reinforcement learning with verifiable rewards (GRPO) on prompts with references, instead of supervised fine-tuning")
    quantize: QuantizeCfg = _f(None, "GGUF export")
    check: CheckCfg = _f(None, "Inference check")
    eval: EvalCfg = _f(None, "Evaluation: held-out sets, in-training samples, lm-evaluation-harness")
    serve: ServeCfg = _f(None, "Server")
    plan: PlanCfg = _f(None, "Target cluster for planning")

    @property
    def pairs(self) -> bool:
        """The recipe trains on chosen/rejected pairs (DPO): its data rows are pairs, its micro-batches two rows each."""
        return self.preference.method != "none"

    @property
    def grpo(self) -> bool:
        """The recipe trains by GRPO: its data rows are prompts with a reference answer, G completions each."""
        return self.rl.method == "grpo"

    def eval_sets(self) -> list[EvalSetCfg]:
        """The held-out sets every stage scores (eval, check, in-training samples); without eval.sets, data.heldout
        scored exact (what check scores)."""
        if self.eval.sets:
            return list(self.eval.sets)
        if self.data.heldout:
            return [EvalSetCfg(name="heldout", path=self.data.heldout, scorer="exact",
                               max_new_tokens=self.check.max_new_tokens)]
        return []

    @property
    def out(self) -> Path:
        p = Path(self.output_dir or f"runs/{self.name}")
        return p if p.is_absolute() else REPO_ROOT / p

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Recipe)}
_SECTION_CLASSES = {"model": ModelCfg, "data": DataCfg, "train": TrainCfg, "peft": PeftCfg,
                    "preference": PreferenceCfg, "rl": RlCfg, "quantize": QuantizeCfg,
                    "check": CheckCfg, "eval": EvalCfg, "serve": ServeCfg, "plan": PlanCfg}


def _build_source(raw: Any, where: str) -> SourceCfg:
    if isinstance(raw, str):
        raw = {"path": raw}
    src = build(SourceCfg, raw, where)
    if not src.path:
        raise RecipeError(f"{where}.path: every data source needs a path or hub id.")
    fmt = FORMATS[src.format]
    names = fmt.columns
    for key, col in src.columns.items():  # a mistyped name would otherwise be ignored and the field read unmapped
        if key not in names or not isinstance(col, str):
            raise RecipeError(f"{where}.columns: {key!r}: {col!r} is not a mapping of one of format {src.format}'s "
                              f"fields {list(names)} to your column name.{suggest(str(key), names)}")
    if src.roles and (not fmt.message_keys
                      or not all(isinstance(k, str) and v in ROLE_TARGETS for k, v in src.roles.items())):
        raise RecipeError(f"{where}.roles: {src.roles!r}: for formats {_MESSAGE_FORMATS} only, each of your role "
                          f"names mapped to one of {list(ROLE_TARGETS)}, e.g. {{bot: assistant}}.")
    if src.tools is not None:
        if not fmt.chat:
            raise RecipeError(f"{where}.tools: format {src.format} renders no chat template, so it has no tools; "
                              f"remove it.")
        try:
            src.tools = tool_definitions(src.tools)
        except ValueError as e:
            raise RecipeError(f"{where}.tools: {e.args[0]} Fix: {e.args[1]}") from None
    return src


def _build_eval_set(raw: Any, where: str) -> EvalSetCfg:
    es = build(EvalSetCfg, raw, where)
    if not es.name or not es.path:
        raise RecipeError(f"{where}: every eval set needs a name and a path (JSONL with messages + answer).")
    for key in ("forbid", "pattern"):
        try:
            re.compile(getattr(es, key) or "")
        except re.error as e:
            raise RecipeError(f"{where}.{key}: {getattr(es, key)!r} is not a regular expression ({e}).") from None
    return es


def recipe_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p.resolve()
    candidate = RECIPES_DIR / f"{name_or_path}.yaml"
    if candidate.exists():
        return candidate
    known = sorted(x.stem for x in RECIPES_DIR.glob("*.yaml"))
    raise RecipeError(f"recipe '{name_or_path}' not found in {RECIPES_DIR}.{suggest(name_or_path, known)}")


def apply_overrides(raw: dict, overrides: list[str], where: str = "override") -> dict:
    """Apply `section.key=value` strings to a raw recipe mapping."""
    for ov in overrides:
        if "=" not in ov:
            raise RecipeError(f"{where} '{ov}': expected section.key=value, e.g. train.lr=1e-4.")
        key, value = ov.split("=", 1)
        parts = key.split(".")
        if len(parts) > 1 and parts[0] not in SECTIONS:
            raise RecipeError(f"{where} '{ov}': unknown section '{parts[0]}'.{suggest(parts[0], SECTIONS)}")
        node = raw
        for depth, part in enumerate(parts[:-1]):  # deeper than section.key: into a mapping (train.zero.<key>)
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise RecipeError(f"{where} '{ov}': '{'.'.join(parts[:depth + 1])}' is a single value, not a "
                                  f"mapping; set it as {'.'.join(parts[:depth + 1])}=<value>.")
            node = child
        node[parts[-1]] = yaml.safe_load(value) if value != "" else None
    return raw


def from_dict(raw: dict, where: str = "recipe") -> Recipe:
    raw = dict(raw)
    kwargs = {}
    for key, value in raw.items():
        if key not in SECTIONS:
            raise RecipeError(f"{where}: unknown top-level key '{key}'.{suggest(key, SECTIONS)}")
        if key in _SECTION_CLASSES:
            kwargs[key] = build(_SECTION_CLASSES[key], value, f"{where}: {key}")
        else:
            kwargs[key] = coerce(value, str, f"{where}: {key}")
    for key, cls in _SECTION_CLASSES.items():
        kwargs.setdefault(key, cls())
    recipe = Recipe(**kwargs)
    recipe.data.sources = [_build_source(s, f"{where}: data.sources[{i}]") for i, s in enumerate(recipe.data.sources)]
    recipe.eval.sets = [_build_eval_set(s, f"{where}: eval.sets[{i}]") for i, s in enumerate(recipe.eval.sets)]
    if recipe.eval.pairs is not None:
        recipe.eval.pairs = _build_source(recipe.eval.pairs, f"{where}: eval.pairs")
        if not FORMATS[recipe.eval.pairs.format].pair:
            raise RecipeError(f"{where}: eval.pairs.format: '{recipe.eval.pairs.format}' is not a pair format; use one "
                              f"of {[f.name for f in FORMATS.values() if f.pair]}.")
    _validate(recipe, where)
    return recipe


def _validate(r: Recipe, where: str) -> None:
    if r.model.name_or_path is None and r.model.init_config is None:
        raise RecipeError(f"{where}: model needs name_or_path (pretrained) or init_config (from scratch).")
    zero = r.train.zero
    if "stage" in zero and (isinstance(zero["stage"], bool) or zero["stage"] not in (0, 1, 2, 3)):
        raise RecipeError(f"{where}: train.zero.stage={zero['stage']!r}: must be 0, 1, 2 or 3.")
    for key in ("offload_optimizer", "offload_param"):
        if zero.get(key) is not None and not isinstance(zero[key], dict):
            raise RecipeError(f"{where}: train.zero.{key}={zero[key]!r}: a mapping, e.g. "
                              f"train.zero.{key}={{device: cpu}}.")
    if r.train.eval_steps > 0 and r.data.eval_fraction == 0:
        raise RecipeError(f"{where}: train.eval_steps={r.train.eval_steps} needs a validation split: set "
                          f"data.eval_fraction > 0 (e.g. 0.02), or train.eval_steps: 0.")
    if r.data.replay is not None:
        rp = r.data.replay
        if not rp.path:
            raise RecipeError(f"{where}: data.replay.path: name a JSONL of general prompts (e.g. "
                              f"data/general/prompts.jsonl), or set data.replay: null.")
        if not r.model.name_or_path:
            raise RecipeError(f"{where}: data.replay replays the base model's own answers, but this model is "
                              f"initialised at random (model.init_config): set model.name_or_path to a pretrained "
                              f"model, or data.replay: null.")
    longest = max((s for s in r.eval.sets), key=lambda s: s.max_new_tokens, default=None)
    if longest is not None and longest.max_new_tokens > r.serve.max_tokens:
        # lm-evaluation-harness asks zerotune's server for the GGUF's answers: the server would refuse them
        raise RecipeError(f"{where}: eval.sets[{longest.name}].max_new_tokens={longest.max_new_tokens} is more than "
                          f"serve.max_tokens={r.serve.max_tokens}, which the server enforces (zerotune eval asks it for "
                          f"the GGUF's lm-eval answers): raise serve.max_tokens or lower max_new_tokens.")
    if len({s.name for s in r.eval.sets}) != len(r.eval.sets):
        raise RecipeError(f"{where}: eval.sets names must be unique.")
    if r.data.heldout and r.eval.sets:
        # held-out prompts are declared one way: data.heldout is the short form of a single exact-scored set, and
        # eval.sets, once set, is what every stage scores (Recipe.eval_sets), so the other would be ignored
        raise RecipeError(f"{where}: data.heldout ({r.data.heldout}) and eval.sets are both set, and only eval.sets "
                          f"is scored: list it in eval.sets ({{name: heldout, path: {r.data.heldout}, scorer: "
                          f"exact}}) and set data.heldout: null, or set data.heldout alone.")
    if r.peft.method != "none":
        if not r.peft.target_modules or not all(isinstance(m, str) for m in r.peft.target_modules):
            raise RecipeError(f"{where}: peft.target_modules must be a non-empty list of module names.")
        if not all(isinstance(m, str) for m in r.peft.modules_to_save):
            raise RecipeError(f"{where}: peft.modules_to_save must be a list of module names.")
    _validate_preference(r, where)
    _validate_rl(r, where)
    _validate_sequence_parallel(r, where)
    if r.peft.method == "qlora" and r.train.deepspeed:
        raise RecipeError(f"{where}: peft.method=qlora trains a 4-bit bitsandbytes base, which DeepSpeed ZeRO cannot "
                          f"shard; set train.deepspeed: null (use peft.method=lora for ZeRO-3).")


def _validate_sequence_parallel(r: Recipe, where: str) -> None:
    """What sharding a row over train.sequence_parallel ranks needs from the rest of the recipe. The heads and the
    world size are checked where they are known (the model's config: planner/target.py; the launch: train/launch.py)."""
    n, t = r.train.sequence_parallel, r.train
    if n == 1:
        return
    if not t.deepspeed:
        raise RecipeError(f"{where}: train.sequence_parallel={n} shards rows with DeepSpeed's Ulysses attention, which "
                          f"needs DeepSpeed: set train.deepspeed (configs/deepspeed/zero3.json) or "
                          f"train.sequence_parallel: 1.")
    if r.plan.gpus_per_node % n:
        raise RecipeError(f"{where}: train.sequence_parallel={n} does not divide plan.gpus_per_node="
                          f"{r.plan.gpus_per_node}: a row's ranks exchange its heads four times per layer, so they stay "
                          f"inside one node (NVLink); choose a divisor of {r.plan.gpus_per_node}.")
    if r.data.seq_len % n:
        raise RecipeError(f"{where}: data.seq_len={r.data.seq_len} is not a multiple of train.sequence_parallel={n}: "
                          f"each rank holds an equal slice of the row; use a multiple of {n}.")
    if r.pairs:
        raise RecipeError(f"{where}: train.sequence_parallel={n} with preference.method={r.preference.method} is not "
                          f"supported: the pair loss sums each completion's log-probability over its whole row "
                          f"(preference/loss.py), and a sharded row gives each rank a part of it; set "
                          f"train.sequence_parallel: 1.")
    if t.attention == "eager" or (r.data.packing and t.attention == "sdpa"):
        raise RecipeError(f"{where}: train.sequence_parallel={n} with train.attention={t.attention}"
                          f"{' on packed rows' if t.attention == 'sdpa' else ''}: DeepSpeed's Ulysses attention drops "
                          f"the dense mask {t.attention} relies on (ulysses_sp.py uattn_wrapper), so "
                          f"{'documents would attend to each other' if t.attention == 'sdpa' else 'it refuses eager'}; "
                          f"use train.attention=sdpa_docs (or auto), which reads the boundaries from the position ids.")
    if r.peft.method == "qlora":
        raise RecipeError(f"{where}: train.sequence_parallel={n} needs DeepSpeed, which peft.method=qlora cannot use; "
                          f"use peft.method=lora or train.sequence_parallel: 1.")


def check_sequence_parallel_heads(r: Recipe, heads: int, kv_heads: int) -> None:
    """train.sequence_parallel against the model's heads (known from its config.json, not the recipe): each rank
    attends with heads / N query heads, and K/V heads are split the same way or copied (DeepSpeed's Ulysses:
    kv_heads divides N, or N divides kv_heads; ulysses_sp.py UlyssesSPAttentionHF.__init__)."""
    n = r.train.sequence_parallel
    if n > 1 and (heads % n or (kv_heads % n and n % kv_heads)):
        ok = [d for d in range(2, heads + 1) if heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)]
        raise RecipeError(f"{r.name}: train.sequence_parallel={n} does not split this model's {heads} attention heads "
                          f"({kv_heads} key/value heads) evenly over {n} ranks; choose "
                          + (" or ".join(map(str, ok)) if ok else "1 (no divisor works)") + ".")


def _objective_rules(r: Recipe, where: str, objective: str, unpacked: str, trains_on: str,
                     peft_tested: tuple[str, ...] = ()) -> None:
    """What DPO and GRPO both need from the data and the model: unpacked rows, no replay, and full fine-tuning or the
    adapters their tests cover (peft_tested)."""
    if r.data.packing:
        raise RecipeError(f"{where}: {objective}: {unpacked}; set data.packing: false.")
    if r.data.replay is not None:
        raise RecipeError(f"{where}: data.replay mixes supervised conversations into training, and {objective} "
                          f"{trains_on}; set data.replay: null.")
    if r.peft.method != "none" and r.peft.method not in peft_tested:
        tested = " and ".join(("full fine-tuning", *(f"peft.method: {m}" for m in peft_tested)))
        raise RecipeError(f"{where}: {objective} with peft.method={r.peft.method} is not supported yet (tested: "
                          f"{tested}); set peft.method: " + " or ".join(("none", *peft_tested)) + ".")


def _validate_rl(r: Recipe, where: str) -> None:
    """GRPO reads chat rows as prompt + reference answer (the last assistant turn), one row per prompt."""
    if not r.grpo:
        return
    rl = r.rl
    if r.pairs:
        raise RecipeError(f"{where}: rl.method=grpo and preference.method={r.preference.method} are two objectives; "
                          f"run DPO first as its own recipe and start GRPO from its model (model.name_or_path).")
    _objective_rules(r, where, "rl.method=grpo", "prompts are not packed (each is answered group_size times)",
                     "learns from rewards only", peft_tested=("lora",))
    if r.peft.modules_to_save:
        raise RecipeError(f"{where}: peft.modules_to_save={r.peft.modules_to_save} with rl.method=grpo is not supported "
                          f"yet (GRPO's fused loss reads the original lm_head under ZeRO-3); set peft.modules_to_save: [].")
    if r.train.sequence_parallel > 1:
        raise RecipeError(f"{where}: train.sequence_parallel={r.train.sequence_parallel} with rl.method=grpo: "
                          f"rollouts are generated whole on each rank; set train.sequence_parallel: 1.")
    if rl.max_new_tokens >= r.data.seq_len:
        raise RecipeError(f"{where}: rl.max_new_tokens={rl.max_new_tokens} leaves no room for a prompt in "
                          f"data.seq_len={r.data.seq_len}; raise data.seq_len or lower rl.max_new_tokens.")
    if rl.reward not in SCORERS and not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+", rl.reward):
        raise RecipeError(f"{where}: rl.reward={rl.reward!r} is neither a scorer ({', '.join(SCORERS)}) nor a "
                          f"function's dotted path (module.function, e.g. my_rewards.score).")


def _validate_preference(r: Recipe, where: str) -> None:
    """Pair data and the DPO objective go together; the pairs are never packed."""
    pair_fmts = [f.name for f in FORMATS.values() if f.pair]
    kinds = {FORMATS[s.format].pair for s in r.data.sources}
    if r.pairs:
        p = r.preference
        if kinds != {True}:
            raise RecipeError(f"{where}: preference.method={p.method} trains on chosen/rejected pairs, but "
                              f"data.sources has format(s) {sorted({s.format for s in r.data.sources}) or 'none'}: use a "
                              f"pair format ({', '.join(pair_fmts)}) for every source (docs/data.md#preference-pairs).")
        _objective_rules(r, where, f"preference.method={p.method}",
                         "pairs are not packed (a micro-batch holds each pair's chosen and rejected rows, padded)",
                         "trains on pairs only")
        smoothing_ok = {"robust": 0 <= p.label_smoothing < 0.5, "exo_pair": 0 < p.label_smoothing < 1}
        if not smoothing_ok.get(p.loss, p.label_smoothing == 0):
            raise RecipeError(f"{where}: preference.label_smoothing={p.label_smoothing} with preference.loss={p.loss}: "
                              f"robust takes [0, 0.5), exo_pair (0, 1) (e.g. 1e-3), the other losses none (0).")
    elif True in kinds:
        raise RecipeError(f"{where}: data.sources has pair format(s) "
                          f"{sorted({s.format for s in r.data.sources if FORMATS[s.format].pair})}, which only "
                          f"preference tuning reads: set preference.method: dpo, or use a chat format for supervised "
                          f"fine-tuning.")


def load_recipe(name_or_path: str, overrides: list[str] | None = None) -> Recipe:
    path = recipe_path(name_or_path)
    raw = read_yaml(path)
    raw.setdefault("name", path.stem)
    raw = apply_overrides(raw, overrides or [])
    return from_dict(raw, where=str(path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path))


def resolve_path(p: str | None) -> Path | None:
    if p is None:
        return None
    q = Path(p)
    return q if q.is_absolute() else REPO_ROOT / q


def explain() -> str:
    lines = []
    for section, cls in _SECTION_CLASSES.items():
        lines.append(f"{section}:")
        for f in dataclasses.fields(cls):
            d = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"  {f.name}: {d!r:<12} # {help_of(f)}")
            sub = {("eval", "sets"): ("- ", EvalSetCfg), ("data", "replay"): ("", ReplayCfg),
                   ("data", "sources"): ("- ", SourceCfg), ("eval", "pairs"): ("", SourceCfg)}.get((section, f.name))
            if sub:  # typed items and sub-sections: show their fields too
                for g in dataclasses.fields(sub[1]):
                    gd = g.default if g.default is not dataclasses.MISSING else g.default_factory()
                    lines.append(f"    {sub[0]}{g.name}: {gd!r:<10} # {help_of(g)}")
    return "\n".join(lines)
