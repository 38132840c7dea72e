"""train.sequence_parallel in the recipe, the batch arithmetic and the plan: what is refused at load (one line, exit
2), what the data-parallel ranks are, and what the planner divides by N and what it does not."""

from __future__ import annotations

import pytest

from zerotune import batch as batchmod
from zerotune.cli import main
from zerotune.config import RecipeError, load_recipe
from zerotune.planner.compute import compute_plan
from zerotune.planner.memory import GiB
from zerotune.planner.report import format_plan
from zerotune.planner.target import PlanError, resolve

LONG = "llama8b_long_zero3"


@pytest.mark.parametrize("overrides, says", [
    (["train.sequence_parallel=3"], "does not divide plan.gpus_per_node=8"),
    (["train.sequence_parallel=2", "train.deepspeed=null"], "needs DeepSpeed"),
    (["train.sequence_parallel=2", "data.seq_len=32767"], "not a multiple of train.sequence_parallel=2"),
    (["train.sequence_parallel=2", "train.attention=sdpa"], "documents would attend to each other"),
    (["train.sequence_parallel=2", "train.attention=eager"], "it refuses eager"),
])
def test_what_sequence_parallelism_cannot_meet_is_refused_at_load(overrides, says):
    with pytest.raises(RecipeError, match=says):
        load_recipe("llama8b_zero3", overrides)


def test_sequence_parallel_pairs_and_qlora_are_refused():
    with pytest.raises(RecipeError, match="pair loss sums each completion"):
        load_recipe("llama8b_dpo_zero3", ["train.sequence_parallel=2"])
    with pytest.raises(RecipeError, match="needs DeepSpeed"):  # qlora recipes run without DeepSpeed
        load_recipe("llama8b_qlora_t4", ["train.sequence_parallel=2", "plan.gpus_per_node=2"])


def test_heads_that_do_not_split_are_one_line_naming_the_degrees_that_do(capfd):
    # SmolLM2: 9 heads, 3 KV heads. 2 ranks cannot split 9 heads; the message names 3 and 9
    with pytest.raises(RecipeError, match=r"9 attention heads \(3 key/value heads\) .* choose 3 or 9"):
        resolve(load_recipe("smollm2", ["train.sequence_parallel=2"]))
    rc = main(["plan", "smollm2", "train.sequence_parallel=2"])
    err = capfd.readouterr().err
    assert rc == 2 and "choose 3 or 9" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_data_parallel_ranks_carry_the_batch_arithmetic():
    bp = batchmod.of_recipe(load_recipe(LONG), 8)
    assert (bp.data_parallel, bp.grad_accum) == (4, 480)  # 62,914,560 / (32,768 x 1 x 4)
    assert bp.sequences_per_step == 1920  # the lecture's 1,920 rows of 32K
    assert bp.tokens_per_micro_step == 32768 * 4
    # every rank loads its own rows; each is shared by its group: N micro-batches per row loaded
    one = batchmod.of_recipe(load_recipe(LONG, ["train.sequence_parallel=1"]), 8)
    assert bp.steps_per_epoch(10_000) == one.steps_per_epoch(10_000) == -(-1250 // 240)
    with pytest.raises(batchmod.BatchError, match="cannot be split into groups of train.sequence_parallel=2"):
        batchmod.of_recipe(load_recipe(LONG), 7)


def test_the_long_recipe_fits_every_phase_with_the_sequence_parallelism_the_plan_picks():
    p = compute_plan(load_recipe(LONG))
    assert p.recipe_batch.sequence_parallel >= 2 and p.recipe_batch.seq_len >= 32768
    assert p.recipe_batch.fits and all(ph.fits for _, ph in p.phases.items() if ph.runs)
    assert p.recommended is not None and p.recommended.recipe
    # the plan picks the fewest GPUs per row that fit: one fewer does not
    assert not compute_plan(load_recipe(LONG, ["train.sequence_parallel=1"])).recipe_batch.fits
    assert p.time.seconds_per_step and p.time.per_micro_step.sequence_parallel_s > 0
    text = format_plan(p)
    assert "each row shared by 2 GPUs (sequence parallel: 16,384 tokens per GPU)" in text
    assert "sequence parallel 0." in text  # the all-to-alls in the communication term


def test_what_sequence_parallelism_divides_and_what_it_does_not():
    t1 = resolve(load_recipe(LONG, ["train.sequence_parallel=1"]))
    one, two = t1.memory(32768, 1, sp=1), t1.memory(32768, 1, sp=2)
    half = t1.memory(16384, 1, sp=1)
    # per-token terms: a 32K row on 2 GPUs holds what a 16K row holds on one
    for part in ("checkpointed layer inputs", "one-layer recompute", "logits + loss"):
        assert two["parts"][part] == half["parts"][part] < one["parts"][part], part
    # not divided: the model states and DeepSpeed's buffers (ZeRO-3 partitions them over every rank anyway)
    for part in ("model states (DeepSpeed estimator)", "fp32 grad sub-group", "reduce bucket"):
        assert two["parts"][part] == one["parts"][part], part
    # added: one layer's all-to-all copies of q, k, v (8 KV heads: no copies of them at N <= 8)
    assert two["parts"]["Ulysses all-to-all copies (one layer)"] == 2 * 2 * 16384 * (4096 + 2 * 1024)
    # validation and samples run unsharded (disable_in_eval): the full 32K row on one GPU, whatever N; only the
    # step's micro-batches differ, bound on the GPU without SP and kept on the host by DeepSpeed's adapter with it
    p1, p2 = (compute_plan(load_recipe(LONG, [f"train.sequence_parallel={n}"])) for n in (1, 2))
    bound, frag = "GA micro-batches (still bound)", "allocator fragmentation"
    for phase in ("validation", "samples"):
        a, b = getattr(p1.phases, phase).parts, getattr(p2.phases, phase).parts
        assert a[bound] > 0 == b[bound], phase
        assert {k: v for k, v in a.items() if k not in (bound, frag)} == {
            k: v for k, v in b.items() if k not in (bound, frag)}, phase
    assert p2.phases.validation.peak_bytes > 20 * GiB  # a 32K row's no-grad forward, on one GPU


def test_the_all_to_alls_are_charged_per_layer_and_pass_inside_the_node():
    t = resolve(load_recipe(LONG))
    st = t.step_time(32768, 1)
    m = t.shape
    nbytes = 2 * 16384 * (2 * m.q_dim + 2 * m.kv_dim)  # fp16, this GPU's 16K tokens: q, k, v in, the output back
    c = t.cluster
    from zerotune.planner import time as tm

    per = tm.collective_s(nbytes, 2, tm.CLUSTERS[c], False)
    assert st.per_micro_step.sequence_parallel_s == pytest.approx(3 * m.layers * per)  # forward, recompute, backward
    # on the critical path: the micro-step is at least its compute plus the exchanges
    assert st.per_micro_step.exposed_s >= st.per_micro_step.sequence_parallel_s


def test_a_row_too_long_for_one_gpu_is_refused_with_the_sequence_parallelism_that_fits():
    """The 16K recipe at 32K rows: 38.7 GiB on one V100 (issue 52); the preflight names the degree that fits."""
    from zerotune.planner.gate import preflight

    r = load_recipe("llama8b_zero3", ["data.seq_len=32768"])
    p = compute_plan(r)
    assert not p.recipe_batch.fits and p.memory.peak_bytes > 38 * GiB
    assert (p.recommended.seq_len, p.recommended.sequence_parallel) == (32768, 2)
    with pytest.raises(PlanError, match="use data.seq_len=32768 train.micro_batch_size=1 train.sequence_parallel=2"):
        preflight(p, r)
