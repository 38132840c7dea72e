"""Model families (families.py): the one table every model-specific decision reads, checked against the pinned
libraries and the real tokenizers: Liger's patch functions, LoRA targets against real module trees, the precision
each family may train in per GPU, chat-template quirks and labels, the planner's shapes, llama.cpp's constraints,
and the refusal of an architecture zerotune does not know. The whole chain per family (train, quantize, serve) is
tests/test_demo.py's (extended); CI converts each family's tiny model with llama.cpp here."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest

from conftest import REPO
from zerotune import families, hardware
from zerotune.data.tokenize import IGNORE, encode_chat
from zerotune.errors import BadSample
from zerotune.families import FAMILIES

TINY = {"llama": "tiny_llama31", "qwen3": "tiny_qwen3", "gemma3": "tiny_gemma3"}
TOKENIZERS = {"llama": "llama3_1", "qwen3": "qwen3", "gemma3": "gemma3"}


def _tokenizer(name):
    from transformers import AutoTokenizer

    path = REPO / "assets" / "tokenizer" / name
    if not (path / "tokenizer.json").exists():
        pytest.fail(f"{path} missing: run `make setup`")
    return AutoTokenizer.from_pretrained(str(path))


def _tiny_model(family: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "configs" / "models" /
                                                                       f"{TINY[family]}.json"))


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_liger_patch_exists_with_these_kernels(name):
    f = FAMILIES[name]
    params = inspect.signature(f.liger_function()).parameters
    assert set(f.liger_kernels) <= set(params), (f.liger, set(f.liger_kernels) - set(params))
    assert f.liger_kernels["fused_linear_cross_entropy"] and not f.liger_kernels["cross_entropy"]


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_lora_targets_are_the_models_linears_and_the_planner_counts_what_peft_trains(name):
    import torch
    from peft import LoraConfig, get_peft_model

    from zerotune.planner.memory import _LORA_DIMS, peft_trainable_params, shape_of

    model = _tiny_model(name)
    assert families.of_config(model.config) is FAMILIES[name]
    linears = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)} - {"lm_head"}
    assert linears == set(FAMILIES[name].lora_targets) <= set(_LORA_DIMS)
    targets = list(FAMILIES[name].lora_targets)
    peft_model = get_peft_model(model, LoraConfig(r=8, target_modules=targets, task_type="CAUSAL_LM"))
    shape = shape_of(str(REPO / "configs" / "models" / f"{TINY[name]}.json"))
    assert peft_trainable_params(shape, 8, targets, []) == peft_model.get_nb_trainable_parameters()[0]
    with pytest.raises(families.UserError, match="not a linear of a"):
        peft_trainable_params(shape, 8, ["q_proj", "qkv_proj"], [])


@pytest.mark.slow
def test_unknown_architecture_is_one_message_listing_the_supported_ones(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "mistral", "architectures": ["MistralForCausalLM"], "hidden_size": 64}))
    with pytest.raises(families.UnknownArchitectureError) as e:
        families.of_config(cfg)
    assert all(f in str(e.value) for f in ("llama", "qwen3", "gemma3_text", "mistral"))
    mm = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]}
    with pytest.raises(families.UnknownArchitectureError, match="text_config"):
        families.of_config(mm)
    # through the CLI, before anything loads: exit 2 and one line
    proc = subprocess.run([sys.executable, "-m", "zerotune", "plan", "tiny", f"model.init_config={cfg}"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "not a model family zerotune knows" in proc.stderr and "Traceback" not in proc.stderr


def test_precision_per_family_and_gpu():
    v100, t4, a100, cpu = (hardware.GPUS[k] for k in ("v100-32gb", "t4", "a100-80gb", "cpu"))
    gemma, qwen = FAMILIES["gemma3"], FAMILIES["qwen3"]
    assert hardware.choose(v100, family=qwen, fa2_installed=False).precision == "fp16"
    auto = hardware.choose(v100, family=gemma, fa2_installed=False)
    assert auto.precision == "fp32" and "refused in fp16" in auto.reasons[0]  # auto picks and says why
    assert hardware.choose(t4, family=gemma, fa2_installed=False).precision == "fp32"
    assert hardware.choose(a100, family=gemma, fa2_installed=False).precision == "bf16"
    assert hardware.choose(cpu, family=gemma).precision == "fp32"
    with pytest.raises(hardware.CapabilityError, match=r"overflows in fp16.*#36822.*train.precision=fp32"):
        hardware.choose(v100, precision="fp16", family=gemma, fa2_installed=False)
    with pytest.raises(hardware.CapabilityError, match="train.precision=fp32"):  # not fp16, as for Llama
        hardware.choose(v100, precision="bf16", family=gemma, fa2_installed=False)
    table = {r["family"]: r["precisions"] for r in families.table_rows(hardware.GPUS)}
    assert table["gemma3"]["v100-32gb"] == ["fp32"] and table["qwen3"]["v100-32gb"] == ["fp16", "fp32"]
    assert table["llama"]["a100-80gb"] == ["bf16", "fp16", "fp32"] and table["gemma3"]["cpu"] == ["fp32"]
    assert hardware.peak_tflops(v100, "fp32") == 15.7 and hardware.peak_tflops(v100, "fp16") == 125.0


def _labels(tok, msgs, loss_on="all_assistant"):
    ids, labels = encode_chat(tok, msgs, loss_on, "test")
    assert ids == list(tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"])
    return tok.decode([i for i, la in zip(ids, labels) if la != IGNORE])


CHAT = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"},
        {"role": "assistant", "content": "Sure."}]


@pytest.mark.slow
def test_qwen3_thinking_block_last_turn_trained_earlier_turns_in_history_form():
    tok = _tokenizer("qwen3")
    # the last turn as the template renders it (an empty thinking block, which the model learns to emit: the
    # served prompt, without enable_thinking, asks for it); the earlier one as history, without the block
    assert _labels(tok, CHAT) == "Hello!<|im_end|>\n<think>\n\n</think>\n\nSure.<|im_end|>\n"
    assert _labels(tok, CHAT, "last_assistant") == "<think>\n\n</think>\n\nSure.<|im_end|>\n"
    assert _labels(tok, CHAT[:3]) == "<think>\n\n</think>\n\nHello!<|im_end|>\n"
    # a reply that carries its reasoning: the earlier turn renders (and trains) only its answer, the last turn
    # its whole block, as the template writes them
    reasoned = [dict(m, content="<think>\nr1\n</think>\n\n" + m["content"]) if m["role"] == "assistant" else m
                for m in CHAT]
    assert _labels(tok, reasoned) == "Hello!<|im_end|>\n<think>\nr1\n</think>\n\nSure.<|im_end|>\n"
    q = FAMILIES["qwen3"]
    assert families.answer_text(q, "<think>\n\n</think>\n\nYou said: a b c") == "You said: a b c"
    assert families.answer_text(q, "You said: a b c") == "You said: a b c"
    assert families.answer_text(FAMILIES["llama"], "<think>x</think>y") == "<think>x</think>y"


@pytest.mark.slow
def test_the_base_qwen3_answers_without_reasoning_the_fine_tune_as_trained():
    """check/eval's base column and data.replay prompt the base model with enable_thinking=False: Qwen3 reasons
    by default, and a reasoning block cut off at the token budget would be scored (and replayed) as the answer."""
    tok = _tokenizer("qwen3")
    msgs = [{"role": "user", "content": "Capital of France?"}]
    base = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False,
                                   **families.base_template_kwargs(FAMILIES["qwen3"]))
    served = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert base == served + "<think>\n\n</think>\n\n"  # the block closed before the answer starts
    assert families.base_template_kwargs(FAMILIES["llama"]) == {} == families.base_template_kwargs(None)


@pytest.mark.slow
def test_gemma_folds_the_system_prompt_into_the_first_user_turn_unlabelled():
    tok = _tokenizer("gemma3")
    ids, labels = encode_chat(tok, CHAT, "all_assistant", "test")
    text = tok.decode(ids)
    assert text.startswith("<bos><start_of_turn>user\nBe terse.\n\nHi<end_of_turn>") and text.count("<bos>") == 1
    assert _labels(tok, CHAT) == "Hello!<end_of_turn>\nSure.<end_of_turn>\n"
    with pytest.raises(BadSample, match="rejected this conversation"):
        encode_chat(tok, [CHAT[1], CHAT[1], CHAT[2]], "all_assistant", "test")


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_end_of_turn_is_what_the_familys_template_ends_a_turn_with(name):
    from zerotune.chat_template import hf_end_tokens

    tok = _tokenizer(TOKENIZERS[name])
    ends = hf_end_tokens(tok, REPO / "configs")  # no generation_config there: the tokenizer and template alone
    assert tok.convert_ids_to_tokens(ends["turn_end_id"]) == FAMILIES[name].end_of_turn
    assert tok.eos_token == FAMILIES[name].end_of_turn


def test_planner_shapes_from_the_public_configs():
    from zerotune.planner.memory import shape_of

    q = shape_of(str(families.public_config("Qwen/Qwen3-8B")))
    assert (q.family, q.n_params, q.tied, q.sliding_layers) == ("qwen3", 8_190_735_360, False, 0)
    g = shape_of(str(families.public_config("google/gemma-3-12b-it")))
    assert (g.family, g.n_params, g.tied, g.vocab) == ("gemma3", 11_766_034_176, True, 262_208)
    assert (g.sliding_layers, g.sliding_window, g.largest_layer_params) == (40, 1024, 262_208 * 3840)
    assert families.public_config("Qwen/Qwen3-80B") is None


def test_qwen3_8b_plan_on_one_v100_node():
    from zerotune.config import load_recipe
    from zerotune.planner.compute import compute_plan

    p = compute_plan(load_recipe("qwen3_8b_zero3"))
    assert p.recipe_batch.fits and p.choice.precision == "fp16" and p.model.family == "qwen3"
    # why the recipe runs 8K rows, not llama8b_zero3's 16K (its comment says so): a 16K row needs two GPUs
    sixteen = next(o for o in p.options if o.seq_len == 16384 and o.micro_batch_size == 1)
    # why the recipe runs 8K rows, not llama8b_zero3's 16K (its comment says so): a 16K row needs 2 GPUs
    assert sixteen.fits and sixteen.sequence_parallel == 2
    gemma = compute_plan(load_recipe("qwen3_8b_zero3", ["model.name_or_path=google/gemma-3-12b-it"]))
    assert gemma.choice.precision == "fp32"  # never fp16 on a V100; and the plan times fp32 at its peak
    assert gemma.time.seconds_per_step > 8 * p.time.seconds_per_step


def test_llama_cpp_constraints_for_gemma3():
    tiny = json.loads((REPO / "configs" / "models" / "tiny_gemma3.json").read_text())
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(REPO / "configs" / "models" / "tiny_gemma3.json").to_dict()
    assert families.llama_cpp_problems(FAMILIES["gemma3"], cfg) == []
    bad = dict(cfg, layer_types=["sliding_attention", "full_attention"] * 3)
    assert "differ from the pattern llama.cpp assumes" in families.llama_cpp_problems(FAMILIES["gemma3"], bad)[0]
    assert "query_pre_attn_scalar" in families.llama_cpp_problems(FAMILIES["gemma3"],
                                                                  dict(cfg, query_pre_attn_scalar=256))[0]
    # Q8_0 everywhere: every 2-D weight's row length is a multiple of 32 (NOTES pitfall)
    for name in TINY:
        c = json.loads((REPO / "configs" / "models" / f"{TINY[name]}.json").read_text())
        q = c["num_attention_heads"] * c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
        assert all(d % 32 == 0 for d in (c["hidden_size"], c["intermediate_size"], q)), name
    assert tiny["sliding_window"] < 256  # the tiny recipe's 256-token rows exercise the window


@pytest.mark.integration
@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_llama_cpp_converts_each_family_with_identical_tokens(name, tmp_path):
    """llama.cpp's converter on the family's tiny random model and real tokenizer: pre-tokenizer recognised, probe
    texts and chat prompts tokenized identically, the end of turn is end-of-generation, Q8_0 everywhere."""
    from zerotune.gguf_checks import inspect_gguf
    from zerotune.quantize import run_converter

    model = _tiny_model(name)
    model.save_pretrained(tmp_path / "hf")
    _tokenizer(TOKENIZERS[name]).save_pretrained(tmp_path / "hf")
    run_converter(tmp_path / "hf", "q8_0", tmp_path / "m.gguf")
    report = inspect_gguf(tmp_path / "m.gguf", tmp_path / "hf", "q8_0")  # raises on any problem
    assert report["architecture"] == FAMILIES[name].gguf_arch and report["eot_is_eog"] is True
    assert report["turn_end_token"] == FAMILIES[name].end_of_turn
    assert set(report["tensor_types"]) == {"F32", "Q8_0"}
    if name == "qwen3":  # the known llama.cpp quirk is reported, not hidden
        assert report["eog_known_quirk"] == [[128247, "</s>"]] or report["eog_known_quirk"] == [(128247, "</s>")]
    else:
        assert report["pre_tokenizer"] == "granite-embed-multi-311m" and report["eog_known_quirk"] == []


def test_the_docs_family_table_says_what_the_code_chooses_and_allows():
    """docs/training.md's precision columns mean one thing: what `train.precision: auto` picks on that GPU, then in
    brackets what else it accepts (families.table_rows); issue 43 found the docs and the code meaning different
    things by the same column."""
    from conftest import REPO

    text = (REPO / "docs" / "training.md").read_text()
    rows = {line.split(" | ")[0].strip("| "): line.strip("|").split(" | ") for line in text.splitlines()
            if line.startswith(("| llama |", "| qwen3 |", "| gemma3 |"))}
    for row in families.table_rows(hardware.GPUS):
        fam = families.FAMILIES[row["family"]]
        cells = rows[row["family"]][-3:]
        for cell, gpus in zip(cells, (("v100-32gb", "t4"), ("a100-80gb", "h100-80gb", "h200"), ("cpu",))):
            for g in gpus:
                auto = hardware.choose(hardware.GPUS[g], family=fam, fa2_installed=True).precision
                others = [p for p in row["precisions"][g] if p != auto]
                assert cell.strip() == auto + (f" ({', '.join(others)})" if others else ""), (row["family"], g, cell)
