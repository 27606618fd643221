import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infopt.attention import Attention
from infopt.compile import Compile
from infopt.core.errors import RecipeError
from infopt.core.step import STAGES, STEP_TYPES, TRANSFORMS, StepConfig
from infopt.kvcache import Static
from infopt.quantize import Int4WeightOnly, Int8WeightOnly
from infopt.recipe import PRESETS, RULES, Recipe, check_rules, matches


def test_every_spelling_gives_the_same_recipe(tmp_path):
    steps = [Static(max_length=64), Attention("eager"), Int8WeightOnly()]
    a = Recipe.parse(steps)
    b = Recipe.parse({"steps": [s.to_dict() for s in steps]})
    p = tmp_path / "r.yaml"
    p.write_text(a.to_yaml())
    c = Recipe.parse(str(p))
    j = tmp_path / "r.json"
    j.write_text(a.to_json())
    d = Recipe.parse(j)
    assert a == b == c == d
    assert [s.key for s in a.steps] == ["attention", "quantize:int8", "kvcache:static"]


def test_shorthand_and_single_step():
    r = Recipe.parse({"steps": [{"attention": "eager"}, {"quantize": "int8"}]})
    assert r.steps == (Attention("eager"), Int8WeightOnly())
    assert Recipe.parse(Attention("sdpa")).steps == (Attention("sdpa"),)
    assert Recipe.parse({"kvcache": {"kind": "static", "max_length": 32}}).steps == (Static(max_length=32),)


def test_presets_parse():
    for name in PRESETS:
        r = Recipe.parse(name)
        assert r.name == name and r.steps


@pytest.mark.parametrize(
    "bad,needle",
    [
        ({"steps": [{"quantise": {"method": "int8"}}]}, "unknown recipe step 'quantise'"),
        ({"steps": [{"quantize": {"method": "int3"}}]}, "unknown quantize method 'int3'; allowed:"),
        ({"steps": [{"quantize": {"method": "int8", "bits": 4}}]}, "no field(s) 'bits'"),
        ({"steps": [{"quantize": {}}]}, "needs 'method'"),
        ({"steps": [{"attention": {"backend": "fast"}}]}, "Attention.backend='fast' is invalid"),
        ({"steps": [{"kvcache": {"kind": "static", "max_length": -1}}]}, "max_length=-1"),
        ({"steps": [{"attention": "eager"}, {"attention": "sdpa"}]}, "duplicate step"),
        ({"steps": [{"compile": {}}]}, "compile requires kvcache:static"),
        ({"steps": [{"attention": "flex"}, {"kvcache": {"kind": "static"}}, {"compile": {}}]}, "cannot be combined"),
        ({"steps": "int8"}, "'steps' must be a list"),
        ({"quantize": 1, "attention": 2}, "needs a 'steps' list"),
        ({"steps": [], "gate": {"max_kl": -1}}, "gate max_kl=-1"),
        ({"steps": [], "gate": {"kl": 0.1}}, "unknown gate key"),
        ("no-such-preset", "neither a preset"),
        (42, "cannot read a recipe"),
    ],
    ids=["unknown-stage", "unknown-kind", "unknown-field", "missing-kind", "bad-backend", "bad-length", "duplicate",
         "requires", "conflict", "steps-not-list", "no-steps-key", "gate-negative", "gate-key", "preset", "type"],
)
def test_bad_recipes_raise_recipe_error(bad, needle):
    with pytest.raises(RecipeError) as e:
        Recipe.parse(bad)
    assert needle in str(e.value)


def test_malformed_yaml_names_line():
    with pytest.raises(RecipeError, match=r"malformed recipe YAML at line \d+, column \d+"):
        Recipe.from_yaml("steps:\n  - quantize: {method: int8\n  - attention: sdpa\n")


def test_missing_file():
    with pytest.raises(RecipeError, match="does not exist"):
        Recipe.parse("nope/recipe.yaml")


def test_error_messages_name_the_fix():
    with pytest.raises(RecipeError) as e:
        Recipe.parse([Compile()])
    assert "Fix: add kvcache.Static" in str(e.value)


def test_registry_matches_public_names():
    import infopt.attention
    import infopt.batching
    import infopt.compile
    import infopt.kvcache
    import infopt.parallel
    import infopt.quantize
    import infopt.speculative

    mods = (infopt.attention, infopt.compile, infopt.kvcache, infopt.quantize, infopt.parallel, infopt.speculative,
            infopt.batching)
    exported = {getattr(mod, n) for mod in mods for n in mod.__all__ if isinstance(getattr(mod, n), type)}
    registered = {cls for kinds in STEP_TYPES.values() for cls in kinds.values()}
    assert registered <= exported
    assert registered == set(TRANSFORMS)
    for cls in registered:
        assert cls.stage in STAGES


def test_rule_patterns_are_valid_and_match():
    for rule in RULES:
        for pattern in (rule.a, rule.b, *([rule.unless] if rule.unless else [])):
            matches(pattern, Attention())  # raises on a malformed pattern
    assert matches("attention[backend!=eager]", Attention("sdpa"))
    assert not matches("attention[backend!=eager]", Attention("eager"))
    assert matches("kvcache:static", Static())
    assert not matches("kvcache:paged", Static())


def test_compile_beside_batching_compiles_the_engine_not_a_static_decode_step():
    from infopt.batching import Batching
    from infopt.kvcache import Paged

    check_rules([Paged(), Compile(), Batching()])  # the throughput preset's shape: no rule broken
    with pytest.raises(RecipeError, match="compile cannot be combined with kvcache:paged"):
        check_rules([Paged(), Compile()])  # without batching, the compiled decode step needs a static cache
    with pytest.raises(RecipeError, match="compile requires kvcache:static"):
        check_rules([Compile()])
    with pytest.raises(RecipeError, match="AOTInductor packages"):
        check_rules([Compile(aot=True), Batching()])
    check_rules([Compile(aot="auto"), Batching()])
    with pytest.raises(RecipeError, match="batch-invariant steps run eagerly"):
        check_rules([Compile(), Batching(batch_invariant=True)])
    assert [s.stage for s in Recipe.parse("throughput").steps] == ["kvcache", "compile", "batching"]


def test_to_dict_is_json_serializable():
    # through JSON and back: the same steps, in the same order, with the same fields (a lossy to_dict, or one that
    # drops a field from_dict needs, fails here; a non-JSON value fails json.dumps)
    for name in PRESETS:
        recipe = Recipe.parse(name)
        doc = json.loads(json.dumps(recipe.to_dict()))
        assert doc["steps"], name
        again = Recipe.parse(doc)
        assert again.steps == recipe.steps, name
        assert again.to_dict() == doc, name


_step = st.one_of(
    st.builds(Attention, st.sampled_from(["eager", "sdpa", "flex", "flash_attention_2"])),
    st.builds(Int8WeightOnly, compute_dtype=st.sampled_from(["auto", "float32", "bfloat16"]),
              include_lm_head=st.booleans(), group_size=st.sampled_from([None, 32])),
    st.builds(Int4WeightOnly, group_size=st.sampled_from([32, 64, 128]), symmetric=st.booleans()),
    st.builds(Static, st.one_of(st.none(), st.integers(1, 4096))),
    st.builds(Compile, st.sampled_from(["default", "max-autotune"])),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_step, max_size=5))
def test_validator_property(steps):
    """Any list of steps either parses into a canonical, rule-abiding recipe or raises RecipeError."""
    try:
        r = Recipe.parse(steps)
    except RecipeError as e:
        stages = [s.stage for s in steps]
        dup = len(set(stages)) != len(stages)
        broke_rule = True
        try:
            check_rules(steps)
            broke_rule = False
        except RecipeError:
            pass
        assert dup or broke_rule, str(e)
        return
    order = [STAGES.index(s.stage) for s in r.steps]
    assert order == sorted(order)
    assert set(r.steps) == set(steps)
    assert Recipe.from_yaml(r.to_yaml()) == r
    check_rules(r.steps)
    assert all(StepConfig.from_dict(s.to_dict()) == s for s in r.steps)


@pytest.mark.parametrize(
    "bad,needle",
    [
        ({"steps": [{"quantise": {"method": "int8"}}]}, "Did you mean 'quantize'?"),
        ({"steps": [{"quantize": {"method": "itn8"}}]}, "Did you mean 'int8'?"),
        ({"steps": [{"quantize": {"method": "int3"}}]}, "Did you mean 'int4' or 'int8'?"),
        ({"steps": [{"quantize": {"method": "int4", "grup_size": 32}}]}, "Did you mean 'group_size'?"),
        ({"steps": [{"attention": "spda"}]}, "Did you mean 'sdpa'?"),
        ({"steps": [{"compile": {"mode": "max_autotune"}}, {"kvcache": "static"}]}, "Did you mean 'max-autotune'?"),
        ({"steps": [], "gate": {"min_top": 0.9}}, "Did you mean 'min_top1'?"),
        ({"step": []}, "Did you mean 'steps'?"),
        ({"steps": [], "gaet": {}}, "Did you mean 'gate'?"),
        ("cpu_fast", "Did you mean 'cpu-fast'?"),
        ("memory-savr", "Did you mean 'memory-saver'?"),
    ],
    ids=["stage", "method", "method-tie", "field", "backend", "compile-mode", "gate-key", "steps-key", "recipe-key",
         "preset", "preset-typo"],
)
def test_did_you_mean(bad, needle):
    with pytest.raises(RecipeError) as e:
        Recipe.parse(bad)
    assert needle in str(e.value)


def test_no_suggestion_when_nothing_is_close():
    with pytest.raises(RecipeError) as e:
        Recipe.parse({"steps": [{"quantize": {"method": "zzzzzz"}}]})
    assert "Did you mean" not in str(e.value) and "allowed: awq" in str(e.value)


@pytest.mark.parametrize(
    "step,needle",
    [
        ({"quantize": {"method": "int4", "group_size": "32"}},
         "Int4WeightOnly.group_size='32' is invalid: it must be an integer, got the string '32' (write it without "
         "quotes); allowed: 32, 64"),
        ({"kvcache": {"kind": "static", "max_length": 64.5}}, "must be an integer or null, got the number 64.5"),
        ({"quantize": {"method": "int4", "group_size": True}}, "must be an integer, got the boolean true"),
        ({"kvcache": {"kind": "static", "max_length": "64"}}, "must be an integer or null, got the string '64'"),
        ({"kvcache": {"kind": "paged", "prefix_caching": "yes"}}, "must be true or false, got the string 'yes';"),
        ({"quantize": {"method": "gptq", "damp": "0.1"}}, "must be a number, got the string '0.1' (write it"),
        ({"speculative": {"method": "prompt_lookup", "ngram": "1,3"}}, "must be a list, got the string '1,3'"),
    ],
    ids=["int4-g-string", "static-len-float", "int4-g-bool", "static-len-string", "paged-bool-word", "gptq-damp-string",
         "ngram-string"],
)
def test_wrong_type_says_the_type(step, needle):
    with pytest.raises(RecipeError) as e:
        Recipe.parse([step])
    assert needle in str(e.value)


def test_right_type_wrong_value_keeps_allowed_message():
    with pytest.raises(RecipeError) as e:
        Recipe.parse([{"quantize": {"method": "int4", "group_size": 48}}])
    assert "Int4WeightOnly.group_size=48 is invalid; allowed: 32, 64" in str(e.value)
    assert "must be" not in str(e.value)
    Recipe.parse([{"speculative": {"method": "prompt_lookup", "ngram": [1, 2]}}])  # a list is fine for a tuple


def test_malformed_json_file_is_reported_as_json(tmp_path):
    p = tmp_path / "r.json"
    p.write_text('{"steps": [\n  {"quantize": {"method": "int8"}},\n]}\n')
    with pytest.raises(RecipeError) as e:
        Recipe.parse(p)
    msg = str(e.value)
    assert "malformed recipe JSON at line 3, column 1" in msg and "YAML" not in msg
    assert str(p) in msg
    assert Recipe.from_json('{"steps": [{"attention": "eager"}]}').steps == (Attention("eager"),)


def test_malformed_yaml_file_names_the_file(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("steps:\n  - quantize: {method: int8\n  - attention: sdpa\n")
    with pytest.raises(RecipeError, match=r"recipe file '.*r\.yaml': malformed recipe YAML at line 3, column \d+"):
        Recipe.parse(p)


@pytest.mark.parametrize(
    "gate,needle",
    [
        ({"min_top1": 5}, "gate min_top1=5 is out of range: top-1 agreement is a fraction from 0 to 1"),
        ({"min_top1": 98}, "Did you mean 0.98?"),
        ({"min_top1": -0.1}, "min_top1=-0.1 is out of range"),
        ({"max_kl": -0.01}, "max_kl=-0.01 is out of range"),
        ({"max_ppl_ratio": 0.02}, "Did you mean 1.02?"),
        ({"max_kl": "0.01"}, "gate max_kl='0.01' must be a number"),
        ({"max_kl": True}, "must be a number"),
    ],
    ids=["top1-5", "top1-percent", "top1-negative", "kl-negative", "ppl-ratio-below-1", "kl-string", "kl-bool"],
)
def test_gate_ranges(gate, needle):
    with pytest.raises(RecipeError) as e:
        Recipe.parse({"steps": [{"attention": "eager"}], "gate": gate})
    assert needle in str(e.value)


def test_gate_edges_accepted():
    # the closed ends of each range are accepted and kept as given (the parsed recipe carries the gate optimize checks)
    edges = {"min_top1": 1, "max_kl": 0, "max_ppl_ratio": 1.0}
    assert Recipe.parse({"steps": [], "gate": edges}).gate == edges
    assert Recipe.parse({"steps": [], "gate": {"min_top1": 0.0}}).gate == {"min_top1": 0.0}
    assert Recipe.parse({"steps": [], "gate": edges}).to_dict()["gate"] == edges


def test_docs_rules_table_is_generated_from_rules():
    from pathlib import Path

    from infopt.recipe import rules_markdown

    doc = (Path(__file__).resolve().parents[1] / "docs" / "recipes.md").read_text()
    assert rules_markdown() in doc, "docs/recipes.md's rules table is stale: paste infopt.recipe.rules_markdown()"


# -- a misspelt keyword in a step constructor: the recipe mapping's error, "did you mean" included ------------------

_STEP_CLASSES = [pytest.param(cls, id=f"{stage}:{kind}" if kind else stage)
                 for stage, kinds in STEP_TYPES.items() for kind, cls in kinds.items()]


def _typo(name: str) -> str:
    """A near miss of a field name that did_you_mean leads back to it (its last letter dropped, or doubled)."""
    return name[:-1] if len(name) > 4 else name + name[-1]


@pytest.mark.parametrize("cls", _STEP_CLASSES)
def test_a_misspelt_keyword_raises_the_recipe_error_with_did_you_mean(cls):
    import dataclasses

    from infopt.core.errors import UnknownFieldError

    field = dataclasses.fields(cls)[0].name
    typo = _typo(field)
    with pytest.raises(UnknownFieldError) as by_constructor:
        cls(**{typo: 1})
    err = by_constructor.value
    assert isinstance(err, RecipeError) and isinstance(err, TypeError)  # caught either way, as before
    msg = str(err)
    assert f"has no field(s) {typo!r}" in msg and f"Did you mean {field!r}" in msg
    assert f"`infopt recipes --fields {cls.stage if cls.kind is None else cls.stage + ':' + cls.kind}`" in msg

    body = {typo: 1} if cls.kind is None else {cls.discriminator: cls.kind, typo: 1}
    with pytest.raises(UnknownFieldError) as by_mapping:  # the same class and words through a recipe mapping
        StepConfig.from_dict({cls.stage: body})
    assert str(by_mapping.value) == msg


@pytest.mark.parametrize("cls", _STEP_CLASSES)
def test_positional_arguments_still_build_a_step(cls):
    import dataclasses

    example = cls(tensor=2) if cls.stage == "parallel" else cls()  # parallel needs one size set
    values = [getattr(example, f.name) for f in dataclasses.fields(cls) if f.init]
    assert cls(*values) == example
    assert cls(*values[:1], **{f.name: getattr(example, f.name) for f in dataclasses.fields(cls)[1:]}) == example


def test_static_max_len_names_max_length():
    from infopt.core.errors import UnknownFieldError

    with pytest.raises(UnknownFieldError, match=r"has no field\(s\) 'max_len'; allowed fields: max_length, "
                                                r"batch_size, dtype\. Did you mean 'max_length'\?"):
        Static(max_len=128)
    with pytest.raises(UnknownFieldError, match="Did you mean 'max_length'"):  # the step's place in a recipe kept
        Recipe.parse([{"kvcache": {"kind": "static", "max_len": 128}}])
    with pytest.raises(TypeError, match="positional arguments but 5 were given"):  # other call errors stay Python's
        Static(1, None, None, 3)
