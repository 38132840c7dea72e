"""Preference tuning (DPO): what differs from supervised fine-tuning, handed to the training worker as one object.

    loss.py        the DPO loss of a micro-batch of pairs, inside the model's forward: per-row log-probabilities
                   chunked over the completions' label tokens (no sequence x vocabulary logits), the objective's
                   formula from liger-kernel, the gradient computed in forward
    reference.py   the reference model's log-probabilities: computed once, before the first step, by the model being
                   trained (at step 0 it is the reference), cached in the run folder with a fingerprint, reused on
                   resume and requeue
    objective.py   `Objective`: the pair collate, the Trainer (the loss, reward metrics in the log), the reference pass
                   as a callback, validation on the held-out pairs; built by `objective(r)` (None for SFT)
    scoring.py     after training: preference accuracy of the starting and the tuned model (HF and GGUF) on held-out
                   pairs, the tuned model's reward accuracy and margin over the start (`zerotune eval`, `check`)

The data side lives with the other formats (data/formats.py: pair formats, data/prepare.py: one row per pair).
"""
