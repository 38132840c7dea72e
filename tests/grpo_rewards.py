"""Reward functions that misbehave, for tests/test_grpo.py (rl.reward: grpo_rewards.<name>)."""

import time


def raises(completion: str, row: dict) -> float:
    raise KeyError("score")


def sleeps(completion: str, row: dict) -> float:
    time.sleep(5)
    return 1.0


def text(completion: str, row: dict):
    return "high"


def length(completion: str, row: dict) -> float:
    return float(len(completion))
