"""The docs' shell commands name scripts, targets, commands and flags that exist, and their recipes validate."""

from __future__ import annotations

import json
import re

import pytest

from .doc_blocks import ROOT, Block, pages, parse_page
from .doc_commands import _STARTS, Command, all_commands, check, inline_commands

COMMANDS = all_commands()


@pytest.mark.parametrize("cmd", COMMANDS, ids=[f"{c.where}:{c.text[:40]}" for c in COMMANDS])
def test_doc_command_exists_as_written(cmd: Command):
    problems = check(cmd)
    assert not problems, f"{cmd.where}: `{cmd.text}`:\n  " + "\n  ".join(problems)


def test_commands_are_collected():
    """Shell blocks and inline commands of every kind are found (an empty collection would pass vacuously)."""
    progs = {c.argv[0].rsplit("/", 1)[-1] for c in COMMANDS}
    assert {"infopt", "python", "make", "torchrun"} <= progs
    assert any(c.whole for c in COMMANDS) and any(not c.whole for c in COMMANDS)
    assert any(c.argv[0].startswith("scripts/") for c in COMMANDS)


def test_command_blocks_say_they_are_shell():
    """A fenced block of commands is marked ```bash (or ```text for a synopsis), so the checks above see it."""
    bare = []
    for path in pages():
        blocks = parse_page(path)
        outputs = {b.output_line for b in blocks if b.output_line}
        bare += [b.id for b in blocks if b.lang == "" and b.line not in outputs and _STARTS.match(b.code.lstrip())]
    assert not bare, f"command blocks without a language: {bare} (mark them ```bash)"


# -- what the checker catches -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "why"), [
    ("make demos", "no such target"),
    ("python benchmarks/decode_ab.py cpu-fast --round 6", "has no option --round"),
    ("python benchmarks/startup.py --recipe cpu-fast --runs 3", "has no option --runs"),
    ("python benchmarks/no_such.py --json out.json", "does not exist"),
    ("infopt bench --workload decode --recipe cpu-fastest", "not a preset"),
    ("infopt bench --workload decoding --recipe cpu-fast", "invalid choice"),
    ("infopt benchmark --recipe cpu-fast", "no command 'benchmark'"),
    ("infopt demo --repeat 3", "infopt demo has no option --repeat"),
    ("python -m infopt.cli optimize --recipe cpu-fast --dryrun", "has no option --dryrun"),
    ("infopt bench --workload decode --json benchmarks/results/no-such-run.json", "does not exist"),
    ("torchrun --nproc-per-node 2 benchmarks/parallel_tp.py hf --tp 2", "has no option --tp"),
    ("scripts/gpu_lane.sh gpu benchy", "no stage 'benchy'"),
    ("GPU_LANE_BENCH=decode-1b scripts/gpu_lane.sh benchy", "no stage 'benchy'"),
])
def test_a_wrong_command_is_reported(text, why):
    from .doc_commands import _split

    (argv,) = _split(text)
    problems = check(Command("sample.md:L1", argv, text))
    assert any(why in p for p in problems), problems


@pytest.mark.parametrize("text", [
    "infopt bench --workload decode|prompt512 --recipe cpu-fast --repeats 3",  # placeholders where values go
    "/tmp/llama-venv/bin/python benchmarks/llamacpp_compare.py --gguf <shipped Q4_1> --formats Q4_1 Q4_0",
    "infopt recipes memory-saver > my-recipe.yaml",
    "GPU_LANE_MODEL_PARTS=.model2 scripts/gpu_lane.sh decode-default:170 identity:110",
    "infopt demo --recipe cpu-lossless --rounds 3 --question \"...\"",
    "torchrun --nproc-per-node 2 script.py",
])
def test_a_right_command_passes(text):
    from .doc_commands import _split

    for argv in _split(text):
        assert check(Command("sample.md:L1", argv, text)) == []


def test_inline_commands_are_read_from_prose_only(tmp_path):
    page = tmp_path / "sample.md"
    page.write_text("Run `python benchmarks/decode_ab.py cpu-fast\n  --rounds 6` and `infopt eval`.\n\n"
                    "```text\n`infopt nothing`\n```\n")
    found = inline_commands(page)
    assert [c.argv for c in found] == [["python", "benchmarks/decode_ab.py", "cpu-fast", "--rounds", "6"],
                                       ["infopt", "eval"]]
    assert not found[1].whole and check(found[1]) == []  # a mention need not be a whole command line


# -- recipes in the docs --------------------------------------------------------------------------------------

# what a tiny CPU model in one process lacks for a step, as the step's refusal names it
NEEDS_ELSEWHERE = {"parallel": "torch.distributed", "quantize:fp8": "CUDA"}


def _recipe_blocks() -> list[Block]:
    """Every ```yaml block (all of them are recipes) and each ```json block holding a recipe mapping."""
    found = []
    for path in pages():
        for b in parse_page(path):
            if b.lang in ("yaml", "yml"):
                found.append(b)
            elif b.lang == "json":
                try:
                    data = json.loads(b.code)
                except ValueError:
                    continue  # a results sample with "..." in it, not a recipe
                if isinstance(data, dict) and "steps" in data:
                    found.append(b)
    return found


RECIPE_BLOCKS = _recipe_blocks()


@pytest.fixture(scope="module")
def tiny_default():
    """A 30-layer Llama as small as a tiny model, with the default model's positions and layer count."""
    from infopt.models import tiny_model

    return tiny_model("llama", num_layers=30, max_positions=4096)


def _validates(model, recipe):
    import infopt
    from infopt.core.errors import IncompatibleModelError, MissingBackendError

    needs = [NEEDS_ELSEWHERE[s.key] for s in recipe.steps if s.key in NEEDS_ELSEWHERE]
    if not needs:
        infopt.validate(model, recipe)
        return
    with pytest.raises((IncompatibleModelError, MissingBackendError), match="|".join(map(re.escape, needs))):
        infopt.validate(model, recipe)


@pytest.mark.parametrize("block", RECIPE_BLOCKS, ids=[b.id for b in RECIPE_BLOCKS])
def test_doc_recipe_parses_and_validates(block, tiny_default):
    """Each recipe the docs show parses (its steps built, fields checked) and validates against a Llama of the
    default model's shape; a step this process cannot host (torch.distributed, CUDA) is refused for that reason
    alone."""
    from infopt.recipe import Recipe

    recipe = Recipe.from_yaml(block.code)
    assert recipe.steps, f"{block.id}: a recipe block with no steps"
    _validates(tiny_default, recipe)


def test_recipe_blocks_are_collected():
    assert len(RECIPE_BLOCKS) >= 20 and {b.page for b in RECIPE_BLOCKS} >= {"docs/recipes.md", "docs/quantize.md"}


BENCH_RECIPES = sorted((ROOT / "benchmarks" / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("path", BENCH_RECIPES, ids=[p.name for p in BENCH_RECIPES])
def test_benchmark_recipe_parses_and_validates(path, tiny_default):
    """The recipe files the docs' commands name (benchmarks/recipes/) are recipes that apply."""
    from infopt.recipe import Recipe

    _validates(tiny_default, Recipe.parse(str(path)))
