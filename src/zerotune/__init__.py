"""zerotune: end-to-end LLM fine-tuning recipes (data -> finetune -> quantize -> eval -> check -> serve)."""

__version__ = "0.1.0"
