"""What the training worker does differently for DPO, as one object (TRL's style: the trainer and its pieces are handed
over, not threaded through with flags): `for_recipe(r)` returns an `Objective`, or None for supervised fine-tuning.

    collate          a micro-batch of m pairs -> 2m rows (the m chosen, then the m rejected), right-padded to the
                     longest, with their pair indices; chosen and rejected always go through in one forward
    attach(model)    the model's forward answers pair batches (loss.attach)
    trainer_class    PreferenceTrainer: the DPO loss per micro-batch (a mean over its pairs; the Trainer divides by
                     grad-accum, DeepSpeed averages over ranks: the mean over the optimizer step's pairs), and the
                     reward metrics in each logged step
    callbacks(...)   the reference pass (reference.py) before the first step
    validate(...)    validation on the held-out pairs (train/validation.py calls it where SFT has its loss)
"""

from __future__ import annotations

from transformers import Trainer

from ..config import Recipe
from ..layout import layout
from ..metrics import dist_if_initialized
from . import loss as lossmod
from .reference import ReferencePass, cache_key, pair_logps


def for_recipe(r: Recipe, pad_id: int) -> Objective | None:
    return Objective(r, pad_id) if r.pairs else None


class Objective:
    def __init__(self, r: Recipe, pad_id: int):
        p = r.preference
        self.r = r
        self.pad_id = pad_id
        self.loss_fn = lossmod.dpo_loss_fn(p.beta, p.loss, p.label_smoothing, p.nll_alpha)
        self.beta = p.beta
        self.chunk = p.chunk_tokens
        self.reference: dict | None = None  # {"train": (n, 2), "eval": (n, 2)} float64, filled by ReferencePass
        self._sums = None  # this rank's reward statistics since the last log

    def describe(self) -> str:
        p = self.r.preference
        return (f"DPO ({p.loss}, beta {p.beta}"
                + (f", label_smoothing {p.label_smoothing}" if p.label_smoothing else "")
                + (f", + {p.nll_alpha} x the chosen completions' NLL" if p.nll_alpha else "")
                + f"): chosen and rejected in one forward, the loss fused over {p.chunk_tokens}-token chunks of the "
                  "completions (no sequence x vocabulary logits), the reference log-probs computed once")

    # -- data -----------------------------------------------------------------------------------------------
    def collate(self, rows: list[dict]) -> dict:
        import torch

        seqs = ([(row["input_ids"], row["labels"]) for row in rows]
                + [(row["rejected_input_ids"], row["rejected_labels"]) for row in rows])
        n = max(len(ids) for ids, _ in seqs)
        pad = [n - len(ids) for ids, _ in seqs]
        # right-padded, so no real token sees a pad under the causal path: no attention mask (a (rows, 1, S, S) one
        # would take SDPA off is_causal and cost rows x S x S bytes per layer); each row is one document
        return {"input_ids": torch.tensor([list(ids) + [self.pad_id] * k for (ids, _), k in zip(seqs, pad)]),
                "position_ids": torch.arange(n).repeat(len(seqs), 1),
                "labels": torch.tensor([list(lab) + [lossmod.IGNORE] * k for (_, lab), k in zip(seqs, pad)]),
                "pair": torch.tensor([row["pair"] for row in rows])}

    def ref_logps(self, split: str, pair, device):
        """The reference log-probs of a micro-batch, in its row order: [chosen..., rejected...]."""
        import torch

        t = self.reference[split][pair.cpu()]
        return t.t().reshape(-1).to(device=device, dtype=torch.float32)

    # -- the model and the Trainer --------------------------------------------------------------------------
    def attach(self, model) -> None:
        lossmod.attach(model, self.loss_fn, self.chunk)

    @property
    def trainer_class(self):
        return PreferenceTrainer

    def callbacks(self, run, stop=None) -> list:
        """stop: the run's StopOnSignal; a signal during the reference pass stops it (reference.py)."""
        from datasets import load_from_disk

        datasets = {"train": run.train_ds}
        if run.paths.data_eval.exists():
            datasets["eval"] = load_from_disk(str(run.paths.data_eval))
        key = cache_key(run.data_manifest["fingerprint"], run.paths.base, run.choice)
        return [ReferencePass(self, run.paths.reference, key, run.paths.checkpoints, datasets,
                              self.r.train.micro_batch_size, stop)]

    # -- metrics --------------------------------------------------------------------------------------------
    def record(self, logps, rewards) -> None:
        """Add a micro-batch's rewards and log-probs to this rank's sums since the last log."""
        import torch

        m = rewards.numel() // 2
        chosen, rejected = rewards[:m].detach().float(), rewards[m:].detach().float()
        s = torch.stack([torch.tensor(float(m), device=chosen.device), (chosen > rejected).float().sum(),
                         (chosen - rejected).sum(), chosen.sum(), rejected.sum(), logps[:m].detach().float().sum(),
                         logps[m:].detach().float().sum()])
        self._sums = s if self._sums is None else self._sums + s

    def log_values(self, device) -> dict:
        """The reward statistics since the last log, over all ranks (every rank logs the same step: a collective)."""
        import torch

        s = self._sums.to(device) if self._sums is not None else torch.zeros(7, device=device)
        self._sums = None
        d = dist_if_initialized()
        if d:
            d.all_reduce(s)
        n, correct, margin, chosen, rejected, lp_c, lp_r = s.tolist()
        if not n:
            return {}
        return {"rewards/accuracy": correct / n, "rewards/margin": margin / n, "rewards/chosen": chosen / n,
                "rewards/rejected": rejected / n, "logps/chosen": lp_c / n, "logps/rejected": lp_r / n}

    def validate(self, model, device) -> dict:
        """On the validation pairs: the DPO loss (val_loss, the training loss's units), reward accuracy and margin.
        The caller holds the model in eval mode under no_grad (train/validation.py)."""
        import torch

        ds = self._eval_ds()
        if ds is None or len(ds) == 0:
            return {}
        pol = pair_logps(model, ds, self.collate, self.r.train.micro_batch_size, device)
        ref = self.reference["eval"]
        # label tokens per row as the loss counts them: positions after the first (lossmod.label_positions' shift)
        tokens = torch.tensor([sum(t != lossmod.IGNORE for t in lab[1:]) for key in ("labels", "rejected_labels")
                               for lab in ds[key]])
        loss, rewards = self.loss_fn(torch.cat([pol[:, 0], pol[:, 1]]).float(),
                                     torch.cat([ref[:, 0], ref[:, 1]]).float(), tokens)
        m = len(ds)
        chosen, rejected = rewards[:m], rewards[m:]
        return {"val_loss": float(loss), "val_reward_accuracy": float((chosen > rejected).float().mean()),
                "val_reward_margin": float((chosen - rejected).mean()), "val_pairs": m}

    def _eval_ds(self):
        if not hasattr(self, "_eval"):
            from datasets import load_from_disk

            path = layout(self.r).data_eval
            self._eval = load_from_disk(str(path)) if path.exists() else None
        return self._eval


class PreferenceTrainer(Trainer):
    """HF Trainer whose loss is DPO's (objective.py docstring). Nothing else of the Trainer changes: DeepSpeed, the
    schedule, checkpoints and resume are the Trainer's, so zerotune's callbacks work as for SFT."""

    def __init__(self, *args, objective: Objective, **kw):
        super().__init__(*args, **kw)
        self.objective = objective
        # the loss is a mean over each micro-batch's pairs: the Trainer divides it by grad-accum (no loss kwargs)
        self.model_accepts_loss_kwargs = False
        self.loss_is_scaled_for_ga = False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        pair = inputs.pop("pair")
        out = model(**inputs, ref_logps=self.objective.ref_logps("train", pair, inputs["input_ids"].device))
        self.objective.record(out["logps"], out["rewards"])
        return (out["loss"], out) if return_outputs else out["loss"]

    def log(self, logs: dict, *args, **kw) -> None:
        if "loss" in logs:  # a training step's log (all ranks call it together)
            logs = {**logs, **self.objective.log_values(self.args.device)}
        super().log(logs, *args, **kw)
