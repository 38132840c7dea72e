"""LoRA and QLoRA through the same stages (issue 8).

Training wraps the loaded model with peft adapters (QLoRA: a 4-bit NF4 bitsandbytes base, no
DeepSpeed); rank 0 saves only the adapter. Publishing runs in a fresh process (`finalize`):

1. adapter reload: the saved adapter on a freshly loaded base (4-bit for QLoRA, the same
   quantization as in training) must reproduce the trained model's probe logits;
2. merge: the adapter is applied to the base loaded on the CPU in the training dtype
   (`verify.model_dtype`: 16-bit on GPUs, fp32 on CPU runs) and merged there, never into a 4-bit
   base (peft #2321, transformers #31293); the merged model's logits must equal base + adapter
   (unmerged, same base) within `peft.merge_atol` in fp32 (default 1e-3: an fp32 merge only
   reorders additions, measured max |diff| ~1e-6 on the tiny model), and within the 16-bit reload
   tolerance (`verify.logit_tolerance`) for a 16-bit merge, which rounds W + BA once;
3. the merged model is saved (same dtype) to runs/<name>/model with the tokenizer, the in-memory
   copies are freed, and it is verified by reload (`verify.verify_saved_model`), so quantize /
   check / serve run unchanged. Peak host RAM: one 16-bit copy of the base plus the adapter and
   one layer's merge temporaries (8B: 18.0 GB; `zerotune plan` prints it as "finalize").

For QLoRA the 4-bit-trained adapter on the 16-bit base differs from the trained 4-bit model by
the NF4 quantization error of the base; that difference is reported (`qlora_16bit_vs_4bit_logit_diff`)
but not gated.
"""

from __future__ import annotations

import gc
import shutil
from pathlib import Path

from . import manifest as mf
from .attention import load_name
from .config import Recipe
from .families import of_config
from .layout import layout
from .verify import SaveVerificationError, compare_logits, logit_tolerance, model_dtype, verify_saved_model

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")


def enabled(r: Recipe) -> bool:
    return r.peft.method != "none"


def compute_dtype(on_gpu: bool, precision: str | None):
    """QLoRA's compute dtype: the run's precision (hardware.choose, which knows the family: a Gemma 3 run on a T4
    computes in fp32, never fp16); fp16 on a GPU when the precision is not known (older hand-offs)."""
    import torch

    if precision is None:
        return torch.float16 if on_gpu else torch.float32
    return model_dtype(precision)


def bnb_config(on_gpu: bool, precision: str | None = None):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype(on_gpu, precision))


def load_kwargs(r: Recipe, on_gpu: bool, precision: str | None = None) -> dict:
    """Extra from_pretrained kwargs: QLoRA loads the base in 4-bit NF4 onto this rank's device."""
    import os

    if r.peft.method != "qlora":
        return {}
    kw = {"quantization_config": bnb_config(on_gpu, precision), "dtype": compute_dtype(on_gpu, precision)}
    if on_gpu:
        kw["device_map"] = {"": int(os.environ.get("LOCAL_RANK", 0))}
    return kw


def lora_config(r: Recipe):
    from peft import LoraConfig

    targets = r.peft.target_modules
    return LoraConfig(r=r.peft.r, lora_alpha=r.peft.alpha, lora_dropout=r.peft.dropout, task_type="CAUSAL_LM",
                      target_modules="all-linear" if targets == ["all-linear"] else list(targets),
                      modules_to_save=list(r.peft.modules_to_save) or None)


def keep_4bit_layout(model) -> None:
    """Keep bitsandbytes' 4-bit weights in their trained layout on CPUs with AVX512-BF16. There, an eval-mode,
    no-grad forward repacks them in place for a CPU kernel, and saving a checkpoint unpacks them again; that
    round trip is not lossless (bitsandbytes 0.50.2, nn/modules.py Linear4bit.forward/_save_to_state_dict), so
    a validation pass followed by a checkpoint changed the frozen base: the saved adapter on a freshly loaded
    base then differed from the trained model by 0.034 in logits. GPUs never take this path."""
    import bitsandbytes as bnb

    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False


def wrap(model, r: Recipe):
    """Add adapters (after prepare_model_for_kbit_training for QLoRA); returns (model, trainable, total)."""
    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers import set_seed

    of_config(model.config).check_lora_targets(r.peft.target_modules)

    # lora_A is drawn from the global RNG here, before the Trainer seeds it: without this, two runs of the same
    # recipe start from different adapters (found by the resume test: grad norms differed at step 1)
    set_seed(r.train.seed)
    if r.peft.method == "qlora":
        keep_4bit_layout(model)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=r.train.gradient_checkpointing,
                                                gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, lora_config(r))
    if r.peft.method == "lora" and r.train.deepspeed:
        # ZeRO-3 hooks every module, and a LoRA linear is five (peft's wrapper, the base layer, dropout, A, B):
        # 3.4x the hooks of full fine-tuning, paid in every forward (in generate: per token) and once, quadratically,
        # in DeepSpeed's trace scan at step 2 (bench/README.md). As one leaf, ZeRO-3 hooks the wrapper alone and
        # gathers the base weight and both adapters together at its entry. smollm2_lora, 4 steps on 2 CPU ranks:
        # identical losses and grad norms, training 335 s instead of 466 s, peak memory +1.5%.
        from deepspeed.utils import set_z3_leaf_modules
        from peft.tuners.lora import Linear as LoraLinear

        set_z3_leaf_modules(model, [LoraLinear])
        # Seen with deepspeed 0.19.8: when no layer input requires grad (frozen embeddings, and no gradient
        # checkpointing, which turns input gradients on itself), a leaf's backward met its LoRA weights still
        # partitioned ("size of tensor a (0)"). Input gradients cost one layer's input-gradient product.
        model.enable_input_require_grads()
    trainable, total = model.get_nb_trainable_parameters()  # counts 4-bit params at their logical size
    return model, trainable, total


def set_optim(args, r: Recipe) -> None:
    if r.peft.optim != "auto":
        from transformers.training_args import OptimizerNames

        args.optim = OptimizerNames(r.peft.optim)


def _logits(model, probe):
    import torch

    model.eval()
    dev = next(model.parameters()).device
    with torch.no_grad():
        # use_cache=False: packed position_ids give a block-causal mask only without a KV cache
        return model(**{k: v.to(dev) for k, v in probe.items()}, use_cache=False).logits.float().cpu()


def finalize_peft(r: Recipe, tmp: Path, out: Path, ref, base: Path, tokenizer_save) -> dict:
    """Verify the saved adapter, merge it into the 16-bit base and publish adapter/ and model/.
    `ref` is the workers' train.handoff.Probe: the trained model's logits on a short probe."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    for f in ADAPTER_FILES:
        if not (tmp / f).exists():
            raise SaveVerificationError(f"{tmp}: {f} was not written.")
    probe, ref_logits = ref.probe, ref.logits
    attn = load_name(ref.attention)  # the probe is a packed prefix: the kernel training ran, at every reload
    on_gpu = torch.cuda.is_available()
    report = {"method": r.peft.method, "trainable_params": ref.trainable_params}

    # 1. adapter reload on the base as trained (4-bit for QLoRA) == the trained model's logits
    if r.peft.method == "qlora":
        kw = {"quantization_config": bnb_config(on_gpu, ref.precision), "dtype": compute_dtype(on_gpu, ref.precision)}
        if on_gpu:
            kw["device_map"] = {"": 0}
        trained_base = AutoModelForCausalLM.from_pretrained(str(base), attn_implementation=attn, **kw)
        keep_4bit_layout(trained_base)  # the same kernels as in training
    else:
        trained_base = AutoModelForCausalLM.from_pretrained(str(base), dtype=model_dtype(ref.precision),
                                                            attn_implementation=attn)
    reloaded = _logits(PeftModel.from_pretrained(trained_base, str(tmp)), probe)
    d = compare_logits(reloaded, ref_logits)["max_abs_logit_diff"]
    tol = logit_tolerance(ref.precision, ref_logits)
    if d > tol:
        raise SaveVerificationError(f"{tmp}: the reloaded adapter's logits differ from the trained model's by {d:.3g} "
                                    f"(tolerance {tol:.3g}).")
    report["adapter_reload_max_abs_logit_diff"] = d
    del trained_base
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()  # the 4-bit base leaves the GPU before the 16-bit work on the CPU

    # 2. merge into the base loaded on the CPU in the training dtype (never into a 4-bit base)
    dtype = model_dtype(ref.precision)
    base16 = AutoModelForCausalLM.from_pretrained(str(base), dtype=dtype, attn_implementation=attn)
    n_base = sum(p.numel() for p in base16.parameters())
    pm = PeftModel.from_pretrained(base16, str(tmp))
    unmerged = _logits(pm, probe)
    if r.peft.method == "qlora":
        report["qlora_16bit_vs_4bit_logit_diff"] = (unmerged - ref_logits).abs().max().item()
    merged = pm.merge_and_unload()
    merged.config.use_cache = False  # as the full fine-tuning save (the trained model's config)
    merged_logits = _logits(merged, probe)
    dm = compare_logits(merged_logits, unmerged)["max_abs_logit_diff"]
    mtol, what = ((r.peft.merge_atol, "peft.merge_atol") if dtype == torch.float32 else
                  (logit_tolerance(ref.precision, unmerged), f"the {ref.precision} tolerance"))
    if dm > mtol:
        raise SaveVerificationError(f"merged model's logits differ from base + adapter by {dm:.3g} "
                                    f"({what} {mtol:.3g}).")
    report["merge_max_abs_logit_diff"] = dm

    # 3. save merged model (+ tokenizer), verify by reload, publish adapter/ and model/
    mtmp = out.with_name(out.name + ".merged.tmp")
    shutil.rmtree(mtmp, ignore_errors=True)
    merged.save_pretrained(str(mtmp))
    tokenizer_save(mtmp)
    del merged, pm, base16  # the reload must not sit beside a second copy (8B: 16 GB each in 16-bit)
    gc.collect()
    saved = verify_saved_model(mtmp, n_base, probe, merged_logits, ref.precision, ref.attention)
    report.update({k: saved[k] for k in ("params", "files", "max_abs_logit_diff", "top1_agreement", "probe_tokens")})
    adir = layout(r).adapter
    atmp = adir.with_name(adir.name + ".tmp")
    shutil.rmtree(atmp, ignore_errors=True)
    atmp.mkdir(parents=True)
    for f in tmp.iterdir():
        if f.name.startswith("adapter_") or f.name == "README.md":
            shutil.copy2(f, atmp / f.name)
    mf.publish(atmp, adir)
    mf.publish(mtmp, out)
    shutil.rmtree(tmp, ignore_errors=True)
    return report
