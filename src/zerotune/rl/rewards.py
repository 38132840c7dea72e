"""A completion's reward, and its advantage within its group.

The reward (rl.reward) is an eval scorer (scorers.py: the task's own measure, e.g. json_fields, or json_field_share
for partial credit per field) or the user's function by dotted path, f(completion: str, row: dict) -> a number, row
= {"prompt": the conversation before the answer as text (the chat template's special tokens and generation header
off), "answer": the reference (the training row's last assistant turn)}. A user function runs under a time limit (rl.reward_timeout_s, SIGALRM: the worker's
main thread). A call that raises, runs past the limit or returns a non-number (None, a string, NaN) is the user's
error: one line naming the function and the prompt, exit 2 (rl.on_reward_error: stop); or, on_reward_error: skip,
the prompt's whole group gets advantage 0 (no gradient from it) and the skip is counted in the step's log. Never
silently a 0: a reward of 0 teaches "this answer is bad", which a crashed scorer does not know.

Advantages (GRPO, Shao et al. 2024, as TRL computes them): per group of G completions of one prompt, reward minus
the group's mean, divided by the group's standard deviation (unbiased, + 1e-4) unless rl.scale_rewards is false
(Dr. GRPO, Liu et al. 2025: the division favours groups whose rewards barely differ). A group whose rewards are all
equal has advantage 0 everywhere: it teaches nothing, and its share is logged (zero_std_groups).
"""

from __future__ import annotations

import importlib
import math
import numbers
import signal
import sys
import threading
from contextlib import contextmanager

from ..config import REPO_ROOT, RlCfg
from ..errors import UserError
from ..scorers import SCORERS, score


class RewardError(UserError):
    pass


class _Timeout(BaseException):
    """Not an Exception: a user function's own `except Exception` must not swallow its time limit."""


def load(rl: RlCfg):
    """The recipe's reward as f(completion, row) -> float; a dotted path is imported now, so a typo stops the run
    before the model loads."""
    if rl.reward in SCORERS:
        return lambda completion, row: score(rl.reward, completion, row)
    module, _, name = rl.reward.rpartition(".")
    if str(REPO_ROOT) not in sys.path:  # a recipe's reward module beside the recipes, as scripts/ import theirs
        sys.path.append(str(REPO_ROOT))
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise RewardError(f"rl.reward: cannot import module '{module}' ({e}); put it on PYTHONPATH or in the repo "
                          f"root, or name a scorer ({', '.join(SCORERS)}).") from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise RewardError(f"rl.reward: module '{module}' ({getattr(mod, '__file__', '?')}) has no function "
                          f"'{name}'; define {name}(completion: str, row: dict) -> float there.")
    return fn


@contextmanager
def _time_limit(seconds: float):
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("rewards run on the worker's main thread (SIGALRM enforces rl.reward_timeout_s)")

    def expire(signum, frame):
        raise _Timeout()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _shorten(text: str, n: int = 60) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n - 3] + "..."


def _tail(text: str, n: int = 80) -> str:
    """A prompt's end, where its question is (its start is the chat template's system turn)."""
    text = " ".join(str(text).split())
    return text if len(text) <= n else "..." + text[-(n - 3):]


class Rewards:
    """The rewards of a micro-batch's completions: `of(completions, rows)` -> (list of float or None per completion,
    None = skipped after an error under on_reward_error: skip)."""

    def __init__(self, rl: RlCfg):
        self.rl = rl
        self.fn = load(rl)

    def one(self, completion: str, row: dict) -> float | None:
        rl = self.rl
        why = None
        try:
            with _time_limit(rl.reward_timeout_s):
                value = self.fn(completion, row)
        except _Timeout:
            why = f"ran past rl.reward_timeout_s={rl.reward_timeout_s:g} s"
        except Exception as e:  # the user's code: any exception is theirs to fix
            why = f"raised {type(e).__name__}: {_shorten(e, 120)}"
        else:
            if isinstance(value, numbers.Real) and math.isfinite(float(value)):
                return float(value)
            why = f"returned {_shorten(repr(value), 40)}, not a finite number"
        if rl.on_reward_error == "skip":
            return None
        raise RewardError(f"rl.reward {rl.reward} {why} on the training prompt "
                          f"ending \"{_tail(row['prompt'])}\"; fix the function, or set rl.on_reward_error: skip to "
                          f"leave such prompts out of their step (counted in the log).")

    def of(self, completions: list[str], rows: list[dict]) -> list[float | None]:
        return [self.one(c, r) for c, r in zip(completions, rows)]


def group_advantages(rewards, group_size: int, scale: bool):
    """rewards: (n,) float tensor, NaN for a skipped completion, in groups of group_size -> (advantages, number of
    groups with zero spread). A group with any NaN is skipped whole: advantage 0."""
    import torch  # here: the launcher imports this module (rewards.load) and stays free of torch

    r = rewards.view(-1, group_size)
    skipped = torch.isnan(r).any(-1, keepdim=True)
    r = torch.where(skipped, torch.zeros_like(r), r)
    adv = r - r.mean(-1, keepdim=True)
    std = r.std(-1, keepdim=True)
    if scale:
        adv = adv / (std + 1e-4)
    adv = torch.where(skipped, torch.zeros_like(adv), adv)
    zero_std = int(((std[:, 0] == 0) & ~skipped[:, 0]).sum())
    return adv.reshape(-1), zero_std
