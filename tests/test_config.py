"""Recipe schema: validation, coercion, overrides, and every shipped recipe loads."""


import re

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


def _schema_fields():
    """(override prefix, field) for every field of the schema, the typed sub-sections included."""
    import dataclasses

    from zerotune.config import _SECTION_CLASSES, EvalSetCfg, ReplayCfg, SourceCfg

    where = {**_SECTION_CLASSES, "data.replay": ReplayCfg, "data.sources[0]": SourceCfg, "eval.sets[0]": EvalSetCfg}
    return [(prefix, f) for prefix, cls in where.items() for f in dataclasses.fields(cls)]


def _bounded_fields():
    """The fields that state their valid values."""
    return [(prefix, f) for prefix, f in _schema_fields() if f.metadata.get("valid")]


def _tiny_with(prefix: str, key: str, value):
    """The tiny recipe with one field set, through the path a recipe file takes (sub-sections in their lists)."""
    import yaml

    raw = yaml.safe_load((RECIPES_DIR / "tiny.yaml").read_text())
    raw["name"] = "tiny"
    if prefix == "data.replay":  # replay needs a pretrained model and a prompt file to be valid at all
        raw["model"] = {"name_or_path": "some/model", "tokenizer": raw["model"]["tokenizer"]}
        raw["data"]["replay"] = {"path": "data/general/prompts.jsonl", key: value}
    elif prefix == "data.sources[0]":
        raw["data"]["sources"][0] = {**raw["data"]["sources"][0], key: value}
    elif prefix == "eval.sets[0]":
        raw["data"]["heldout"] = None
        raw["eval"] = {"sets": [{"name": "task", "path": "data/tiny/heldout.jsonl", key: value}]}
    else:
        section, k = prefix, key
        raw.setdefault(section, {})[k] = value
    return from_dict(raw, where="recipes/tiny.yaml")


@pytest.mark.slow
@pytest.mark.parametrize("prefix,fld", _bounded_fields(), ids=lambda x: getattr(x, "name", x))
def test_every_bounded_field_refuses_a_value_outside_and_takes_its_edges(prefix, fld):
    """A value outside a field's stated range is one message naming the file, the key, the value and the range,
    at load, before any stage starts (plan.nodes=0 was a ZeroDivisionError, train.warmup_ratio=3 three warmup
    steps to transformers 5, train.lr=-1 gradient ascent). The edges themselves load."""
    b = fld.metadata["valid"]
    integer = fld.type in ("int", "Optional[int]")
    step, cast = (1, int) if integer else (0.5, float)
    below = cast(b.lo if b.lo_open else b.lo - step)
    with pytest.raises(RecipeError) as e:
        _tiny_with(prefix, fld.name, below)
    assert str(e.value) == f"recipes/tiny.yaml: {prefix}.{fld.name}={below!r}: must be {b}.", str(e.value)
    if b.hi is not None:
        above = cast(b.hi if b.hi_open else b.hi + step)
        with pytest.raises(RecipeError, match=rf"{re.escape(fld.name)}={above!r}: must be {re.escape(str(b))}\.$"):
            _tiny_with(prefix, fld.name, above)
    inside = [v for v in (b.lo, b.hi) if v is not None and v in b] or [b.lo + step]
    for v in inside:
        if prefix == "eval.sets[0]" and fld.name == "max_new_tokens" and v > 1024:
            continue  # the serve.max_tokens cross-check, not this bound
        r = _tiny_with(prefix, fld.name, cast(v))
        assert r is not None


def test_every_number_states_its_range_or_why_it_has_none():
    """A new numeric field gets a Bound, or a line here saying why any value is valid."""
    any_value = {"model.init_seed", "data.seed", "train.seed",  # seeds
                 "train.max_steps",  # <= 0: epochs decide
                 "preference.label_smoothing"}  # its range depends on preference.loss: _validate_preference
    numbers = {f"{p}.{f.name}" for p, f in _schema_fields() if any(t in str(f.type) for t in ("int", "float"))}
    bounded = {f"{p}.{f.name}" for p, f in _bounded_fields()}
    assert numbers - bounded == any_value, numbers - bounded - any_value


def test_bounds_are_printed_by_explain():
    from zerotune.config import explain

    text = explain()
    assert "Fraction of steps spent warming up (in [0, 1))" in text and "Peak learning rate (> 0)" in text
    assert all(str(f.metadata["valid"]) in text for _, f in _bounded_fields())


def test_heldout_prompts_are_declared_one_way_data_heldout_or_eval_sets():
    """data.heldout is the short form of one exact-scored set; with eval.sets beside it, it used to be ignored
    silently (Recipe.eval_sets scores eval.sets alone). Both set: refused, naming both keys and the fix."""
    from zerotune.config import RecipeError, load_recipe

    sets = "eval.sets=[{name: task, path: data/tiny/heldout.jsonl, scorer: contains}]"
    with pytest.raises(RecipeError) as e:
        load_recipe("tiny", [sets])
    msg = str(e.value)
    assert msg.startswith("recipes/tiny.yaml: data.heldout (data/tiny/heldout.jsonl) and eval.sets are both set")
    assert "set data.heldout: null" in msg and "\n" not in msg
    assert [s.name for s in load_recipe("tiny", [sets, "data.heldout=null"]).eval_sets()] == ["task"]
    assert [(s.name, s.scorer) for s in load_recipe("tiny").eval_sets()] == [("heldout", "exact")]
