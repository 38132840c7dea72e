"""The planner: DeepSpeed-consistent model states, a breakdown that sums, exact batches, every recipe."""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import pytest

from zerotune.config import RECIPES_DIR, load_recipe
from zerotune.planner.compute import compute_plan
from zerotune.planner.gate import preflight
from zerotune.planner.records import Plan
from zerotune.planner.report import dry_run, format_plan
from zerotune.planner.target import PlanError

MODEL_STATES = "model states (DeepSpeed estimator)"


@pytest.fixture(scope="module")
def plan8b():
    return compute_plan(load_recipe("llama8b_zero3"))


def test_8b_model_states_equal_deepspeed_estimator(plan8b):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    assert plan8b.model.n_params == 8_030_261_248
    _, gpu, _ = estimate_zero3_model_states_mem_needs(8_030_261_248, plan8b.model.largest_layer_params, 8, 1,
                                                      cpu_offload=False, cpu_offload_params=False, zero_init=True)
    assert plan8b.memory.parts[MODEL_STATES] == gpu == 20_169_434_112  # NOTES' figure


def test_breakdown_sums_to_peak(plan8b):
    assert sum(plan8b.memory.parts.values()) == plan8b.memory.peak_bytes


def test_8b_recommendation(plan8b):
    rec = plan8b.recommended
    dp = plan8b.cluster.world_size // rec.sequence_parallel
    assert rec.seq_len * rec.micro_batch_size * dp * rec.grad_accum == 62_914_560
    assert (rec.seq_len, rec.micro_batch_size, rec.grad_accum, rec.sequence_parallel) == (16384, 1, 480, 1)  # own
    ch = plan8b.choice
    assert (ch.precision, ch.attention, ch.liger) == ("fp16", "sdpa_docs", True)
    # 32K at micro-batch 1 does not fit 32 GB on one GPU without offload (NOTES): its row is split over 2 (Ulysses)
    long = next(o for o in plan8b.options if o.seq_len == 32768 and o.micro_batch_size == 1)
    assert long.fits and long.sequence_parallel == 2
    assert 1 < plan8b.time.seconds_per_step / 3600 < 6


RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


@functools.cache
def _recipe_plan(name: str, overrides: tuple[str, ...] = ()) -> Plan:
    return compute_plan(load_recipe(name, list(overrides)))  # frozen records: tests share it without changing it


@pytest.mark.slow
@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_plans(name):
    p = _recipe_plan(name)
    assert p.memory.peak_bytes == sum(p.memory.parts.values())
    assert p.options


def _every_field_written(x, js, where: str = "plan") -> None:
    """Every field of every record in `x` is a key of its JSON object `js`, all the way down: a field dropped from
    to_json fails here even where from_json's default would rebuild the same value."""
    if dataclasses.is_dataclass(x):
        assert isinstance(js, dict), where
        missing = {f.name for f in dataclasses.fields(x)} - js.keys()
        assert not missing, f"{where}: {sorted(missing)} not written"
        for f in dataclasses.fields(x):
            _every_field_written(getattr(x, f.name), js[f.name], f"{where}.{f.name}")
    elif isinstance(x, (list, tuple)):
        assert isinstance(js, list) and len(js) == len(x), where
        for i, (a, b) in enumerate(zip(x, js)):
            _every_field_written(a, b, f"{where}[{i}]")
    elif isinstance(x, dict):
        assert isinstance(js, dict) and js.keys() == x.keys(), where
        for k in x:
            _every_field_written(x[k], js[k], f"{where}[{k!r}]")
    else:
        assert js == x, where


# beside every recipe, the records no shipped recipe plans: each kind of warning, and the replay prompts' error
ROUND_TRIP_VARIANTS = [("llama8b_qlora_t4", ("plan.cpu_ram_gb=16",)),  # FinalizeHostRam
                       ("llama8b_zero3_offload", ("plan.gpu=cpu", "plan.cpu_ram_gb=64")),  # OffloadUnmodelled, HostRam
                       ("llama8b_zero3", ("train.zero.zero_hpz_partition_size=8",)),  # HpzCopy
                       ("llama8b_zero3", ("data.replay.path=/nonexistent/prompts.jsonl",))]  # replay_error


@pytest.mark.slow
@pytest.mark.parametrize("name,overrides", [(n, ()) for n in RECIPES] + ROUND_TRIP_VARIANTS)
def test_plan_json_round_trips_exactly(name, overrides, tmp_path):
    """plan.json is the plan: every record and field written (to_json), and read back (from_json, Plan.read) equal
    to what compute_plan returned, types included (tuples, warnings' kinds, None)."""
    from zerotune import manifest as mf

    p = _recipe_plan(name, overrides)
    assert not overrides or p.warnings or p.replay_error  # a variant plans what it is here for
    js = json.loads(json.dumps(p.to_json()))  # plain JSON: no default= to hide a value JSON cannot hold
    _every_field_written(p, js)
    assert Plan.from_json(js) == p
    path = tmp_path / "plan" / "plan.json"
    mf.write(path, p.to_json())  # as `zerotune plan` and the launch write it
    assert Plan.read(path) == p
    assert Plan.read(tmp_path / "none.json") is None


def test_offload_moves_optimizer_off_gpu():
    p = compute_plan(load_recipe("llama8b_zero3_offload"))
    assert p.memory.parts[MODEL_STATES] < 8 * 2**30 and p.memory.cpu_bytes_per_node > 100e9
    assert "fp32 grad sub-group" not in p.memory.parts


@pytest.mark.parametrize("recipe,seq,ga", [("llama8b_zero3", "16,384", "480"), ("qwen3_8b_zero3", "8,192", "960")])
def test_dry_run_text(recipe, seq, ga):
    r = load_recipe(recipe)
    text = dry_run(compute_plan(r), r)
    for needle in ["world size     8", "fp16", "sdpa", "Liger kernels  on", seq, ga, "62,914,560", "GiB", "fits"]:
        assert needle in text, needle


def test_preflight_raises_when_impossible():
    r = load_recipe("llama8b_zero3", ["data.seq_len=131072", "train.micro_batch_size=8",
                                      "train.global_batch_tokens=67108864"])
    with pytest.raises(PlanError, match="exceeds"):
        preflight(compute_plan(r), r)
    with pytest.raises(PlanError, match="not a multiple"):  # 62,914,560 / (131072 x 8 x 8) is not whole
        r = load_recipe("llama8b_zero3", ["data.seq_len=131072", "train.micro_batch_size=8"])
        preflight(compute_plan(r), r)
    r = load_recipe("llama8b_zero3")
    preflight(compute_plan(r), r)  # fits: no error
    tiny = load_recipe("tiny", ["plan.cpu_ram_gb=0.01"])
    assert not compute_plan(tiny).recipe_batch.fits
    preflight(compute_plan(tiny), tiny)  # a CPU target: predicted not to fit, never refused (plan.gpu cpu)


def test_nothing_fits_suggests_switches():
    p = compute_plan(load_recipe("llama8b_zero3", ["train.liger=off", "data.seq_len=32768"]), gpus_per_node=2)
    assert p.recommended is None and p.suggestions


def test_inference_sizes(plan8b):
    q8 = plan8b.inference.of("q8_0")
    assert abs(q8.gguf_bytes / 2**30 - 7.95) < 0.02 and q8.t4_fits
    assert plan8b.inference.kv_bytes_per_token == 128 * 1024
    assert not plan8b.inference.of("f16").t4_fits


@pytest.mark.slow
def test_plan_main_writes_png(tmp_path):
    from zerotune.plan import plan_main

    r = load_recipe("tiny", [f"output_dir={tmp_path}"])
    assert plan_main(r, as_json=True) == 0
    assert (tmp_path / "plan" / "memory.png").stat().st_size > 1000


def test_disk_preflight_refuses_a_too_small_file_system(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from zerotune.planner.gate import disk_preflight

    r = load_recipe("llama8b_zero3", [f"output_dir={tmp_path / 'run'}"])
    d = compute_plan(r).disk
    # 12 B/param Adam + fp32 master and 2 B/param fp16 weights per checkpoint; 3 at once with save_total_limit 2
    assert d.checkpoint_bytes == 14 * 8_030_261_248 and d.checkpoints_at_once == 3
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 * 2**40, 0, 100 * 2**30))
    # the worst event of a fresh run: the third checkpoint written while two are committed (rotation follows
    # the commit); finalize (two checkpoints + the 16-bit model.tmp) needs less
    with pytest.raises(PlanError, match=r"100.0 GiB free; this run needs 314.1 GiB more at its save at "
                                        r"save_total_limit \(it holds no checkpoint yet.*save_total_limit=2"):
        disk_preflight(compute_plan(r), r, tmp_path / "run")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 * 2**40, 0, 400 * 2**30))
    disk_preflight(compute_plan(r), r, tmp_path / "run")  # room enough: no error
    assert d.peak_bytes == 3 * d.checkpoint_bytes < 400 * 2**30


@pytest.mark.slow
@pytest.mark.parametrize("packing", [True, False])
def test_the_plan_books_the_steps_the_worker_trains(tmp_path, packing):
    """One count of optimizer steps (BatchPlan.total_steps), in sequences, as the Trainer takes them. Unpacked,
    tiny's 2,769 documents are 1,385 micro-batches per rank (accelerate rounds up), 693 steps of GA 2 per epoch
    (the last one partial): 1,386 in 2 epochs, where the plan's old tokens / global batch (78,966 / 1,024)
    booked 154."""
    from datasets import load_from_disk

    from zerotune.batch import derive
    from zerotune.data.prepare import prepare
    from zerotune.train.args import total_steps

    r = load_recipe("tiny", [f"output_dir={tmp_path}", f"data.packing={str(packing).lower()}", "train.epochs=2"])
    prepare(r)
    n = len(load_from_disk(str(tmp_path / "data" / "train")))
    bp = derive(r.train.global_batch_tokens, r.data.seq_len, r.train.micro_batch_size, 2)
    data = compute_plan(r, gpu="cpu", gpus_per_node=2, nodes=1).data
    per_rank = math.ceil(n / 2)  # micro-batch 1, world 2
    assert data.train_sequences == n and data.total_steps == total_steps(n, bp, r) == 2 * math.ceil(per_rank / 2)


# --- self-distilled replay: the data step's answering (planner/replay.py replay_plan) ---------------------------

REPLAY = ["data.replay.path=data/general/prompts.jsonl"]


def test_8b_replay_fits_one_v100_and_takes_minutes(plan8b):
    from zerotune.planner.replay import REPLAY_DECODE_EFFICIENCY

    assert plan8b.replay is None  # no data.replay: nothing to plan
    rp = compute_plan(load_recipe("llama8b_zero3", REPLAY)).replay
    assert (rp.prompts, rp.batch_size, rp.max_new_tokens, rp.precision) == (320, 8, 128, "fp16")
    # the longest prompt of the shipped file has 162 bytes of content; + the template bound, 40 + 8 per message
    assert rp.prompt_tokens == 162 + 40 + 8 and rp.prompt_tokens_from.startswith("bound from the prompts' UTF-8")
    # the whole model in fp16 on one GPU (not ZeRO-partitioned) against what PyTorch reports usable on a V100
    ph = rp.run.phase
    assert ph.parts["weights (16-bit, whole model, one device)"] == 2 * 8_030_261_248
    assert ph.capacity_bytes == int(31.75 * 2**30) and ph.fits and ph.peak_bytes < 18 * 2**30
    assert ph.peak_bytes == sum(ph.parts.values()) and rp.largest_batch_that_fits is None
    # 40 batches x 128 steps, each reading 16 GB at 900 GB/s x the assumed efficiency (+ the cache, + prefill)
    floor = 40 * 128 * 2 * 8_030_261_248 / (900e9 * REPLAY_DECODE_EFFICIENCY)
    assert rp.run.batches == 40 and rp.run.time.memory_bound and floor < rp.run.time.seconds < 1.25 * floor
    assert rp.run.generated_tokens_max == 320 * 128
    text = format_plan(compute_plan(load_recipe("llama8b_zero3", REPLAY)))
    assert "replay (data step, before training, one GPU): the base model answers 320 prompts" in text
    assert "fits" in text and "memory-bound" in text
    assert "tokens (bound from the prompts' UTF-8 bytes until `make data`)" in text
    # data.replay.limit: the first N prompts only
    assert compute_plan(load_recipe("llama8b_zero3", [*REPLAY, "data.replay.limit=10"])).replay.prompts == 10


def test_replay_batch_too_large_is_reported_not_refused():
    r = load_recipe("llama8b_zero3", [*REPLAY, "eval.batch_size=512"])
    p = compute_plan(r)
    rp = p.replay
    # 320 rows at once (never more rows than prompts): the prompts' KV cache and the prefill's MLP outgrow 32 GB
    assert rp.run.rows == 320 and not rp.run.phase.fits and rp.run.phase.peak_bytes > rp.run.phase.capacity_bytes
    largest = rp.largest_batch_that_fits
    assert 8 < largest < 320
    assert compute_plan(load_recipe("llama8b_zero3", [*REPLAY, f"eval.batch_size={largest}"])).replay.run.phase.fits
    assert not compute_plan(load_recipe("llama8b_zero3", [*REPLAY, f"eval.batch_size={largest + 1}"])).replay.run.phase.fits
    text = format_plan(p)
    assert "DOES NOT FIT" in text and f"fix: lower eval.batch_size (eval.batch_size={largest} fits)" in text
    # answering ran in the data step, before finetune: it is no reason to refuse the training job
    preflight(p, r)  # no error
    assert p.replay.run.phase.fits is False


def test_replay_on_a_cpu_target_is_host_ram_without_a_time():
    rp = compute_plan(load_recipe("llama8b_zero3", [*REPLAY, "plan.gpu=cpu"])).replay
    assert rp.precision == "fp32" and rp.run.phase.limit == "host" and rp.run.time is None
    assert rp.run.phase.parts["weights (32-bit, whole model, one device)"] == 4 * 8_030_261_248
    assert rp.run.phase.capacity_bytes == int(384e9)  # one process: the node's RAM, not a rank's share


def test_replay_with_a_missing_prompt_file_is_reported(tmp_path):
    p = compute_plan(load_recipe("llama8b_zero3", [f"data.replay.path={tmp_path / 'none.jsonl'}"]))
    assert p.replay is None and "not found" in p.replay_error
    assert "replay (data step): not planned:" in format_plan(p)


SMOLLM2_DIR = RECIPES_DIR.parent / "assets" / "models" / "smollm2-135m-instruct"
# Content a chat prompt can carry: accents, CJK, emoji (4 UTF-8 bytes each), runs of spaces and newlines, digits,
# zero-width characters, a special token typed as text
ODD = ["naïve café, crème brûlée", "東京タワーはどこですか？", "🚀🚀🚀 launch 🌍", "    lots   of   spaces\n\n\n  and\ttabs",
       "1234567890" * 8, "\u200b\u200bzero\u200bwidth", "مرحبا بالعالم", "<|eot_id|> typed <|im_end|> by a user", "a"]


@pytest.mark.slow
def test_replay_prompt_bound_holds_for_the_llama31_and_smollm2_templates(tokenizer):
    """Byte-level BPE never gives more tokens than UTF-8 bytes, and the template overhead fits the stated bound
    (planner/replay.py REPLAY_TEMPLATE_TOKENS + REPLAY_TOKENS_PER_MESSAGE per message), for the real Llama-3.1
    tokenizer and SmolLM2's, on the shipped prompts and on odd content."""
    import json

    from transformers import AutoTokenizer

    from zerotune.planner.replay import REPLAY_TEMPLATE_TOKENS, REPLAY_TOKENS_PER_MESSAGE, replay_prompt_bound

    if not (SMOLLM2_DIR / "tokenizer.json").exists():
        pytest.fail(f"{SMOLLM2_DIR} missing: run `make setup`")
    shipped = [json.loads(line) for line in (RECIPES_DIR.parent / "data" / "general" / "prompts.jsonl")
               .read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = shipped + [{"messages": [{"role": "user", "content": c}]} for c in ODD] + [
        {"messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": ODD[1]}]}]
    for tok in (tokenizer, AutoTokenizer.from_pretrained(str(SMOLLM2_DIR))):
        for row in rows:
            for msg in row["messages"]:
                assert len(tok.encode(msg["content"], add_special_tokens=False)) <= len(msg["content"].encode())
            ids = tok.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"]
            assert len(ids) <= replay_prompt_bound([row]), (tok.name_or_path, row)
    # Llama 3.1-Instruct's own template (the hub's; the tokenizer shipped here carries Llama 3's) opens with a
    # system block holding the knowledge cutoff and a date even without a system message; rendered as it renders
    # one user turn without tools
    header = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
              "Today Date: 26 Jul 2024\n\n<|eot_id|>")
    assert len(tokenizer.encode(header, add_special_tokens=False)) == 26
    for row in rows[:20] + rows[-len(ODD) - 1:-1]:
        text = (header + f"<|start_header_id|>user<|end_header_id|>\n\n{row['messages'][-1]['content'].strip()}"
                "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
        assert len(tokenizer.encode(text, add_special_tokens=False)) <= replay_prompt_bound([row])
    assert 26 + 4 + 5 <= REPLAY_TEMPLATE_TOKENS + REPLAY_TOKENS_PER_MESSAGE
