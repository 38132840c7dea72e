"""Every scorer: one hit and one near-miss (an answer a sloppier scorer would accept)."""

import pytest

from zerotune.scorers import SCORERS, mean_score, normalize, score

CASES = {
    # scorer: (row, hit, near-miss)
    "exact": ({"answer": "Paris"}, "  Paris\n", "paris"),
    "normalized": ({"answer": "The Eiffel Tower"}, "eiffel  tower!", "Eiffel Towers"),
    "contains": ({"answer": "Paris"}, "The capital of France is Paris.", "Parisian food is good."),
    "regex": ({"answer": "42", "pattern": r"Answer:\s*(\S+)"}, "so... Answer: 42.", "42 is it. Answer: 24"),
    "numeric": ({"answer": "1234.5"}, "first 7, then the total is 1,234.5", "1234.5 then 1234.6"),
    "json_valid": ({"answer": "{}"}, '```json\n{"a": [1, 2]}\n```', "{'a': 1}"),
    "json_fields": ({"answer": '{"name": "Ada", "age": 36}'}, '{"age": 36, "name": "Ada", "x": 1}',
                    '{"name": "Ada", "age": "36"}'),
    "json_field_share": ({"answer": '{"name": "Ada", "age": 36}'}, '{"age": 36, "name": "Ada"}', '{"nom": "Ada"}'),
}


def test_every_scorer_has_a_case():
    assert set(CASES) == set(SCORERS)


@pytest.mark.parametrize("name", sorted(CASES))
def test_hit_and_near_miss(name):
    row, hit, miss = CASES[name]
    assert score(name, hit, row) == 1.0
    assert score(name, miss, row) == 0.0


def test_json_field_share_gives_partial_credit_per_field():
    row = {"answer": '{"name": "Ada", "age": 36, "city": "Leiden"}'}
    assert score("json_field_share", '{"name": "Ada", "age": 36, "city": "Lisbon"}', row) == pytest.approx(2 / 3)
    assert score("json_fields", '{"name": "Ada", "age": 36, "city": "Lisbon"}', row) == 0.0
    assert score("json_field_share", "not json", row) == 0.0


def test_normalize():
    assert normalize("  The  Cat, an   owl!  ") == "cat owl"


def test_contains_is_whole_word():
    assert score("contains", "14", {"answer": "4"}) == 0.0
    assert score("contains", "it is 4.", {"answer": "4"}) == 1.0


def test_numeric_tolerance_is_relative():
    assert score("numeric", "1000000.0005", {"answer": "1e6"}) == 1.0
    assert score("numeric", "1000002", {"answer": "1e6"}) == 0.0
    assert score("numeric", "no number", {"answer": "3"}) == 0.0


def test_regex_set_pattern_and_row_override():
    row = {"answer": "b"}
    assert score("regex", "x=b", row, pattern=r"x=(\w)") == 1.0
    assert score("regex", "y=b", {**row, "pattern": r"y=(\w)"}, pattern=r"x=(\w)") == 1.0
    with pytest.raises(ValueError, match="pattern"):
        score("regex", "x=b", row)


def test_json_fields_needs_object_answer():
    with pytest.raises(ValueError, match="JSON object"):
        score("json_fields", "{}", {"answer": "[1]"})
    assert score("json_fields", "[1]", {"answer": '{"a": 1}'}) == 0.0


def test_unknown_scorer_and_mean():
    with pytest.raises(ValueError, match="unknown scorer"):
        score("bleu", "a", {"answer": "a"})
    rows = [{"answer": "a"}, {"answer": "b"}]
    assert mean_score("exact", ["a", "c"], rows) == 0.5


@pytest.mark.parametrize("answer,leaked", [
    ('{"language": "French"}', True),                  # the task's JSON, whole
    ('```json\n{"language": "French"}\n```', True),   # fenced, as chat models like to
    ('```json\n{"language": "Fren', True),            # fenced and cut off at max_new_tokens
    ('{"world": 7"}', True),                           # broken JSON: still the task's format
    ('  [1, 2, 3]', True),                             # a JSON array
    ("There are 7 continents.", False),                # plain prose
    ("In Python a dict looks like {1: 2}.", False),    # braces mid-sentence: prose that mentions JSON
    ("7", False),                                      # a bare JSON scalar is a plain answer, not the format
    ("", False),
])
def test_json_shaped_is_the_json_tasks_leak_test(answer, leaked):
    from zerotune.scorers import json_shaped, leak_test

    assert json_shaped(answer) is leaked
    assert leak_test("json_fields")(answer) is leaked and leak_test("json_valid")(answer) is leaked


def test_forbid_replaces_the_task_format_and_content_scorers_define_none():
    from zerotune.scorers import FORMATS, leak_test

    assert set(FORMATS) <= set(SCORERS)
    for name in ("exact", "normalized", "contains", "regex", "numeric"):
        assert leak_test(name) is None  # no output format: leakage is not measured
    forbid = leak_test("contains", r"^You said:")
    assert forbid("You said: red cat") and not forbid("I said: You said:")
    only_keys = leak_test("json_fields", r'"(name|age)"\s*:')  # a set whose right answers are JSON themselves
    assert only_keys('{"name": "Ada"}') and not only_keys('{"colour": "red"}')
