"""Evaluation during training: validation loss on the prepared eval split, and greedy answers to a few held-out
prompts, every `train.eval_steps` optimizer steps and at the last step.

Runs inside the training workers on the Trainer's own model (never a second copy). Under ZeRO-3 every forward
gathers parameters with collectives, so every rank must make the same calls: each rank takes a disjoint shard
of the eval rows, shards are padded to equal length with a row whose labels are all -100 (it adds 0 NLL and 0
tokens), and the summed NLL and label-token count are all-reduced. The loss is the model's own causal-LM loss
in sum mode (labels shifted as HF shifts them), divided by the label-token count: the training loss's units.
Generation: answering.py's greedy answers, as check and eval generate them (same chat template, same stop
tokens), one prompt per generate() call as the planner budgets it (planner/phases.py samples); all ranks answer
the same prompts with synced_gpus=True (a rank that finished keeps joining the gathers of the others).

When: after the step's checkpoint is committed (on_save), or before the next step when the step saves nothing.
The Trainer calls on_step_end before it saves (transformers 5.23 trainer.py:1949-1950, then
_maybe_log_save_evaluate: log, evaluate, save): a validation there that fails (out of memory at 16K on a
V100) would lose the step it follows, and a requeued job would repeat that step and fail again. A run stopping
for a signal or the deadline skips the pending validation: its time belongs to the save.

Memory: the forward runs in eval mode, where Liger's patched forward materialises the full logits unless told
otherwise (liger_kernel 0.8.5 transformers/model/llama.py:113-115, skip_logits defaults to `self.training and
labels is not None`), and transformers' ForCausalLMLoss upcasts them to fp32 (loss/loss_utils.py:61): at 16K x
128,256 about 21 GiB. With Liger on, nll_sum passes skip_logits=True: the fused linear cross entropy, as in
training, and no sequence x vocabulary tensor.

The result amends the step's metrics.jsonl row with val_loss / val_ppl (one row per step, as resume and the
tests expect), goes to stdout, and to wandb when on; answers go to runs/<r>/train/samples.jsonl.
"""

from __future__ import annotations

import contextlib
import math
import time

from transformers import TrainerCallback

from .. import faults
from .. import manifest as mf
from ..answering import hf_generate, load_rows
from ..chat_template import stop_ids
from ..config import Recipe
from ..data.cache import load_tokenizer
from ..families import answer_text, of_config
from ..hub import local_folder
from ..gathering import planned, whole_model
from ..layout import layout
from ..metrics import dist_if_initialized
from ..planner.records import Plan
from ..scorers import score


def _row_tensors(row: dict, device) -> dict:
    import torch

    return {k: torch.tensor([row[k]], dtype=torch.long, device=device) for k in ("input_ids", "labels", "position_ids")}


def nll_sum(model, rows: list[dict], device, liger: bool = False) -> tuple[float, int]:
    """(summed NLL over label tokens, label tokens) of `rows`, one forward per row, in the caller's mode
    (eval + no_grad). A row whose labels are all -100 contributes nothing but still makes its forward call.
    liger: the model's forward is Liger's; ask it for the fused loss without logits (module docstring)."""
    import torch

    fused = {"skip_logits": True} if liger else {}  # only Liger's forward knows the keyword
    total, count = torch.zeros((), dtype=torch.float64), 0
    for row in rows:
        batch = _row_tensors(row, device)
        n = int((batch["labels"][..., 1:] != -100).sum())  # the tokens ForCausalLMLoss counts after its shift
        # num_items_in_batch turns the model's own loss (HF's or Liger's) into a sum over label tokens
        out = model(**batch, use_cache=False, num_items_in_batch=torch.tensor(1.0, device=device), **fused)
        if n:
            total += out.loss.detach().double().cpu()
            count += n
    return float(total), count


def shard(n_rows: int, rank: int, world: int) -> list[int | None]:
    """Row indices for `rank`: round-robin, padded with None so every rank makes ceil(n / world) calls."""
    mine = list(range(rank, n_rows, world))
    return mine + [None] * (math.ceil(n_rows / world) - len(mine))


def distributed_val_loss(model, ds, device, liger: bool = False) -> tuple[float, int]:
    """Mean NLL per label token over the whole eval split, computed across all ranks: (loss, label tokens)."""
    import torch

    d = dist_if_initialized()
    rank, world = (d.get_rank(), d.get_world_size()) if d else (0, 1)
    dummy = {**ds[0], "labels": [-100] * len(ds[0]["labels"])}
    rows = [ds[i] if i is not None else dummy for i in shard(len(ds), rank, world)]
    total, count = nll_sum(model, rows, device, liger)
    t = torch.tensor([total, float(count)], dtype=torch.float64)
    if d:
        t = t.to(device)
        d.all_reduce(t)
    total, count = t.tolist()
    return (total / count if count else float("nan")), int(count)


class EvalDuringTraining(TrainerCallback):
    """Validation loss + samples at every `train.eval_steps` and at the last step, after the step's checkpoint is
    committed (see the module docstring). Put it after CommitCheckpoints in the Trainer's callbacks.

    liger: the model runs Liger's forward (the fused loss is asked for in eval mode). stop: the run's
    StopOnSignal; a run stopping at a due step skips that validation."""

    def __init__(self, r: Recipe, step_metrics=None, liger: bool = False, stop=None, measure=None):
        self.r = r
        self.measure = measure  # (model, device) -> val_* fields, in place of the SFT loss (DPO: preference/objective.py)
        self.every = r.train.eval_steps
        self.step_metrics = step_metrics
        self.liger = liger
        self.stop = stop
        self.eval_path = layout(r).data_eval
        self.samples_path = layout(r).samples
        self.failed_path = layout(r).validation_failed
        self._ds = None
        self._prompts = None
        self._rewound = False
        self._pending: int | None = None  # a due step whose validation has not run yet
        self._stepped = False  # this attempt has trained a step
        self.longest_s: float | None = None  # the longest validation + samples of this attempt
        self.trainer = None  # attach: its DeepSpeed engine (made inside train()) gathers the model for the samples
        if stop is not None:  # the deadline reserves the end of training's validation and samples (stopping.py)
            stop.end_estimate = self.end_of_training_s

    def attach(self, trainer) -> None:
        self.trainer = trainer

    def end_of_training_s(self) -> tuple[float, str] | None:
        """(seconds, how it is known) for the validation and samples after the last step: the longest this
        attempt measured, else the launch's plan (layout.run_plan, planner/time.py phase_times), else None."""
        if self.longest_s is not None:
            return self.longest_s, "measured"
        if not self.eval_path.exists() and self.r.eval.samples <= 0:
            return 0.0, "(nothing to validate or sample)"
        plan = Plan.read(layout(self.r).run_plan)
        if plan is None:
            return None
        running = [ph for ph in (plan.phases.validation, plan.phases.samples) if ph.runs]
        seconds = [ph.time.seconds if ph.time else None for ph in running]
        if not running or any(s is None for s in seconds):
            return None
        return sum(seconds), "planned"

    # -- what and when ----------------------------------------------------------------------------------
    def _due(self, state) -> bool:
        return (self.every > 0 and state.global_step % self.every == 0) or state.global_step == state.max_steps

    def on_step_end(self, args, state, control, **kw):
        self._stepped = True
        if self._due(state):
            self._pending = state.global_step
            control.should_log = True  # the step's metrics row is written now; its validation amends it

    def on_save(self, args, state, control, model=None, **kw):
        self._run_pending(args, state, model)  # CommitCheckpoints.on_save ran first: the step is committed

    def on_step_begin(self, args, state, control, model=None, **kw):
        if not self._rewound:  # first step of this attempt: state.global_step is the step resumed from
            self._rewound = True
            if state.is_world_process_zero:
                mf.rewind_jsonl(self.samples_path, state.global_step)
        self._run_pending(args, state, model)  # a due step that saved nothing

    def on_train_end(self, args, state, control, model=None, **kw):
        if not self._stepped and 0 < state.global_step >= state.max_steps:
            # resumed at the last step (its validation failed, or the job stopped before it): no step ran in this
            # attempt, so nothing is pending; validate it now. (The Trainer restores global_step after
            # on_train_begin, transformers 5.23 trainer.py:1653 and :1697, so this cannot be decided earlier.)
            step = state.global_step
            failed = mf.read(self.failed_path)
            if failed and failed.get("step") == step:  # the same validation again would fail again: finish
                if state.is_world_process_zero:
                    print(f"finetune: eval: step {step} validation skipped: it failed in the previous attempt "
                          f"({failed.get('error')}); finalizing without it (`make eval` measures the model "
                          "afterwards)", flush=True)
                return
            if state.is_world_process_zero:  # its earlier attempt's samples, if any, are replaced
                mf.rewind_jsonl(self.samples_path, step - 1)
            self._rewound = True
            self._pending = step
        self._run_pending(args, state, model)  # the last step, when the recipe saves nothing

    def _run_pending(self, args, state, model) -> None:
        step, self._pending = self._pending, None
        if step is None or model is None:
            return
        if self.stop is not None and self.stop.stopped_at == step:  # the same on every rank (reduced)
            if state.is_world_process_zero:
                print(f"finetune: eval: step {step} validation skipped: the run is stopping ({self.stop.reason}); "
                      f"the resumed run validates at its next due step", flush=True)
            return
        self._evaluate(args, state, model, step)

    def _evaluate(self, args, state, model, step: int) -> None:
        t0 = time.perf_counter()
        was_training = model.training
        # generate() turns the KV cache back on in the model's config; training and the final probe rely on it
        # being off (packed position_ids give a block-causal mask only without a cache), so it is restored
        config = getattr(model, "config", None)
        use_cache = getattr(config, "use_cache", None)
        model.eval()
        try:
            import torch

            with torch.no_grad():
                faults.eval_out_of_memory(step)
                row = self._val_loss(model, args.device)
                samples = self._samples(model, args.device, step)
                faults.slow_samples()
        except Exception as e:  # the step is committed; a resumed job must not retry a validation that fails
            if state.is_world_process_zero:
                mf.write(self.failed_path, {"step": step, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            raise
        finally:
            model.train(was_training)
            if config is not None:
                config.use_cache = use_cache
        row["eval_s"] = round(time.perf_counter() - t0, 2)
        self.longest_s = max(self.longest_s or 0.0, row["eval_s"])
        if state.is_world_process_zero:
            self._report(step, row, samples)

    # -- the two measurements -----------------------------------------------------------------------------
    def _val_loss(self, model, device) -> dict:
        if not self.eval_path.exists():
            return {}
        if self.measure is not None:
            return self.measure(model, device)
        if self._ds is None:
            from datasets import load_from_disk
            self._ds = load_from_disk(str(self.eval_path))
        if len(self._ds) == 0:
            return {}
        loss, tokens = distributed_val_loss(model, self._ds, device, self.liger)
        return {"val_loss": loss, "val_ppl": math.exp(loss) if loss < 700 else float("inf"), "val_tokens": tokens}

    def _samples(self, model, device, step: int) -> list[dict]:
        if self.r.eval.samples <= 0:
            return []
        if self._prompts is None:
            self._prompts = _sample_prompts(self.r)
        rows, es, tok, stop = self._prompts
        if not rows:
            return []
        import torch
        from transformers.integrations import is_deepspeed_zero3_enabled

        family = of_config(model.config)  # Qwen3: scored after its thinking block, as check and eval score
        sharded = bool(dist_if_initialized()) and is_deepspeed_zero3_enabled()
        engine = self.trainer.model_wrapped if self.trainer is not None else None
        with (whole_model(engine, device, planned(self.r, "samples")) if sharded else
              contextlib.nullcontext(False)) as gathered:
            preds = hf_generate(model, tok, stop, rows, es.max_new_tokens, batch_size=1, device=device,
                                synced_gpus=sharded and not gathered)
        self.gathered = gathered
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        return [{"step": step, "set": es.name, "prompt": row["messages"][-1].get("content"), "reference": row["answer"],
                 "prediction": pred, "score": score(es.scorer, answer_text(family, pred), row, es.pattern)}
                for row, pred in zip(rows, preds)]

    # -- reporting (rank 0) ---------------------------------------------------------------------------------
    def _report(self, step: int, row: dict, samples: list[dict]) -> None:
        if self.step_metrics is not None:
            self.step_metrics.amend(step, row)  # the step's row, written by StepMetrics.on_log before the save
        parts = [f"step {step}"]
        if "val_ppl" in row:
            parts.append(f"val_loss {row['val_loss']:.4f}, val_ppl {row['val_ppl']:.3g} "
                         f"({row['val_tokens']:,} label tokens)")
        elif "val_reward_accuracy" in row:  # preference pairs (DPO)
            parts.append(f"val_loss {row['val_loss']:.4f}, reward accuracy {row['val_reward_accuracy']:.3f}, "
                         f"margin {row['val_reward_margin']:.4f} ({row['val_pairs']:,} pairs)")
        if samples:
            how = " (the whole model gathered once)" if getattr(self, "gathered", False) else ""
            parts.append(f"samples {sum(s['score'] for s in samples):g}/{len(samples)} correct "
                         f"({samples[0]['set']}{how}); e.g. {samples[0]['prediction']!r}")
        print(f"finetune: eval: {', '.join(parts)} [{row['eval_s']:.1f}s]", flush=True)
        if samples:
            mf.append_jsonl(self.samples_path, samples)
        if self.r.train.report_to == "wandb":
            import wandb

            if wandb.run is not None:
                logs = {f"eval/{k}": v for k, v in row.items()}
                if samples:
                    cols = ["step", "set", "prompt", "reference", "prediction", "score"]
                    logs["eval/samples"] = wandb.Table(columns=cols, data=[[s[c] for c in cols] for s in samples])
                wandb.log({**logs, "train/global_step": step})


def _sample_prompts(r: Recipe):
    """(rows, eval set, tokenizer, stop ids) for the in-training samples: the first eval set's first rows."""
    sets = r.eval_sets()
    if not sets:
        return [], None, None, None
    es = sets[0]
    rows = load_rows(es)[: r.eval.samples]
    tok = load_tokenizer(r)
    stop = stop_ids(tok, local_folder(str(layout(r).base)))  # a hub id: its generation_config in the cache
    return rows, es, tok, stop



