"""Recipe schema: validation, coercion, overrides, and every shipped recipe loads."""


import pytest

from zerotune import ds_config
from zerotune.config import RECIPES_DIR, RecipeError, apply_overrides, from_dict, load_recipe

RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_loads(name):
    r = load_recipe(name)
    assert r.name == name
    assert r.data.sources, "a recipe without data cannot run"


def test_yaml_scientific_notation_is_coerced(tmp_path):
    # PyYAML reads 2e-5 (no dot) as the string '2e-5'
    r = from_dict({"name": "x", "model": {"init_config": "c.json"}, "train": {"lr": "2e-5", "epochs": "3"}})
    assert r.train.lr == 2e-5 and isinstance(r.train.lr, float)
    assert r.train.epochs == 3.0


def test_unknown_key_suggests_the_right_one():
    with pytest.raises(RecipeError, match=r"unknown key 'lrr'.*Did you mean 'lr'"):
        from_dict({"name": "x", "model": {"init_config": "c.json"}, "train": {"lrr": 1e-4}})


def test_unknown_section_and_bad_values():
    with pytest.raises(RecipeError, match="unknown top-level key 'trian'.*'train'"):
        from_dict({"name": "x", "model": {"init_config": "c"}, "trian": {}})
    with pytest.raises(RecipeError, match=r"train.micro_batch_size: expected int, got 'two'"):
        from_dict({"name": "x", "model": {"init_config": "c"}, "train": {"micro_batch_size": "two"}})
    with pytest.raises(RecipeError, match=r"train.precision: 'fp8' is not one of"):
        from_dict({"name": "x", "model": {"init_config": "c"}, "train": {"precision": "fp8"}})
    with pytest.raises(RecipeError, match="model needs name_or_path"):
        from_dict({"name": "x"})


def test_overrides_from_the_command_line():
    r = load_recipe("tiny", ["train.lr=1e-4", "data.seq_len=128", "train.liger=off"])
    assert r.train.lr == 1e-4 and r.data.seq_len == 128 and r.train.liger == "off"
    with pytest.raises(RecipeError, match="expected section.key=value"):
        load_recipe("tiny", ["train.lr"])
    with pytest.raises(RecipeError, match="unknown key 'sequence_len'.*'seq_len'"):
        load_recipe("tiny", ["data.sequence_len=128"])
    with pytest.raises(RecipeError, match="unknown section 'tran'"):
        apply_overrides({}, ["tran.lr=1"])
    # deeper than section.key: into a mapping field (what `zerotune plan` suggests for offload)
    r = load_recipe("llama8b_zero3", ["train.zero.offload_optimizer={device: cpu}", "train.zero.sub_group_size=1e8"])
    zero = ds_config.build(r)["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu"} and zero["sub_group_size"] == 100_000_000  # not '1e8'
    with pytest.raises(RecipeError, match="'train.lr' is a single value, not a mapping"):
        load_recipe("tiny", ["train.lr.x=1"])


def test_missing_recipe_suggests_a_name():
    with pytest.raises(RecipeError, match="recipe 'tinny' not found.*'tiny'"):
        load_recipe("tinny")


def test_cli_refuses_unknown_flags_and_bad_overrides(capsys):
    from zerotune.cli import main

    with pytest.raises(SystemExit):
        main(["data", "tiny", "--no-such-flag"])
    assert main(["data", "tiny", "data.seq_lenn=3"]) == 2
    assert "Did you mean 'seq_len'" in capsys.readouterr().err


def test_make_passes_section_key_overrides_on_its_own_command_line():
    """`make finetune RECIPE=tiny train.lr=1e-3`, as a recipe header suggests: make takes `train.lr` as one of its
    own variables; the Makefile hands every dotted command-line variable on, with ARGS, to the stage."""
    import subprocess

    from conftest import REPO

    out = subprocess.run(["make", "-n", "finetune", "RECIPE=tiny", "train.lr=1e-3", "ARGS=data.seq_len=128"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "-m zerotune finetune tiny train.lr=1e-3 data.seq_len=128" in out, out


def test_the_plan_gpu_is_validated_against_the_gpu_table_at_load():
    """One table of GPUs (hardware.GPUS): the recipe schema refuses a name it lacks, as it does quant types."""
    from zerotune.config import RecipeError, load_recipe
    from zerotune.hardware import GPUS

    with pytest.raises(RecipeError, match=r"plan.gpu: 'v100' is not one of .*Did you mean 'v100-32gb'"):
        load_recipe("tiny", ["plan.gpu=v100"])
    assert {load_recipe("tiny", [f"plan.gpu={g}"]).plan.gpu for g in GPUS} == set(GPUS)


def test_eval_batch_size_below_one_is_refused_at_load():
    from zerotune.config import RecipeError, load_recipe

    with pytest.raises(RecipeError, match=r"eval.batch_size=0: must be at least 1"):
        load_recipe("tiny", ["eval.batch_size=0"])


def test_heldout_prompts_are_declared_one_way_data_heldout_or_eval_sets():
    """data.heldout is the short form of one exact-scored set; with eval.sets beside it, it used to be ignored
    silently (answering.eval_sets scores eval.sets alone). Both set: refused, naming both keys and the fix."""
    from zerotune.answering import eval_sets
    from zerotune.config import RecipeError, load_recipe

    sets = "eval.sets=[{name: task, path: data/tiny/heldout.jsonl, scorer: contains}]"
    with pytest.raises(RecipeError) as e:
        load_recipe("tiny", [sets])
    msg = str(e.value)
    assert msg.startswith("recipes/tiny.yaml: data.heldout (data/tiny/heldout.jsonl) and eval.sets are both set")
    assert "set data.heldout: null" in msg and "\n" not in msg
    assert [s.name for s in eval_sets(load_recipe("tiny", [sets, "data.heldout=null"]))] == ["task"]
    assert [(s.name, s.scorer) for s in eval_sets(load_recipe("tiny"))] == [("heldout", "exact")]
