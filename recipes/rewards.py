"""Reward functions for the recipes' GRPO runs, by dotted path (rl.reward: recipes.rewards.<name>): each takes the
completion's text and its row ({"prompt": ..., "answer": the reference}) and returns a number (rl/rewards.py)."""

import string

_LETTERS = set(string.ascii_letters + " ")


def letters(completion: str, row: dict) -> float:
    """tiny_grpo's: the share of the completion's characters that are ASCII letters or spaces. A random model's
    sampled tokens (a 128K vocabulary of code, digits, scripts) score anywhere in [0, 1], so every group has spread
    and the mechanics have a signal to learn from; not a task."""
    return sum(c in _LETTERS for c in completion) / len(completion) if completion else 0.0
