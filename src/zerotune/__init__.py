"""zerotune: end-to-end LLM fine-tuning recipes (prepare -> train -> quantize -> check -> serve)."""

__version__ = "0.1.0"
