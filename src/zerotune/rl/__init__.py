"""Reinforcement learning with verifiable rewards (rl.method: grpo): rollouts on the training ranks, rewards from the
eval scorers or the user's function, GRPO's loss fused like DPO's (docs/training.md#rl-with-verifiable-rewards-grpo).

    rewards.py     a completion's reward: a scorer or the user's function, with a time limit; group advantages
    rollout.py     G sampled completions per prompt on the training ranks, seeded per step and rank; their rows
    loss.py        GRPO's loss inside the model's forward (Liger's formula, zerotune's fused log-probs)
    objective.py   what the training worker does differently for GRPO (collate, Trainer, metrics)
"""
