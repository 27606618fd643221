"""Figures the docs quote are the figures their results files hold (see tests/doc_figures.py for the markers)."""

from __future__ import annotations

import json

import pytest

from .doc_figures import (
    FIGURE_PAGES,
    ROOT,
    FigureError,
    Marker,
    all_markers,
    check,
    expected,
    markers,
    unmarked,
)

MARKERS = all_markers()


@pytest.mark.parametrize("marker", MARKERS, ids=[m.id for m in MARKERS])
def test_quoted_figure_is_its_results_file_value(marker: Marker):
    check(marker)


@pytest.mark.parametrize("page", sorted(FIGURE_PAGES))
def test_headline_figures_name_their_source(page):
    """README, index, getting started and performance's summary: every measured figure carries a comment."""
    missing = unmarked(ROOT / page, FIGURE_PAGES[page])
    assert not missing, (
        "figures with no <!-- fig: FILE VALUE FORMAT --> (or <!-- fig: - WHY --> where no results file holds "
        "them; see tests/doc_figures.py):\n  " + "\n  ".join(missing))


def test_the_headline_pages_carry_markers():
    """The pages the brief is about are tied to files at all (a parser that found nothing would pass vacuously)."""
    pages = {m.page for m in MARKERS if not m.unbacked}
    assert set(FIGURE_PAGES) <= pages


# -- the checker itself -----------------------------------------------------------------------------------------

_RESULTS = {
    "run.json": {
        "ratios": {"decode_tokens_per_s": 7.7216},
        "model_mb": 97.353,
        "quality": {"kl": 0.005127},
        "rounds": [{"tps": 177.3, "hf": 16.2}, {"tps": 168.0, "hf": 16.0}, {"tps": 172.4, "hf": 15.4}],
        "share": 0.632,
    }
}

_PAGE = """# Sample

Decode went 7.72x <!-- fig: run.json ratios.decode_tokens_per_s %.2fx --> faster, with **97.4 MiB**
<!-- fig: run.json model_mb %.1f MiB --> weights.

| | plain | optimized |
|---|---|---|
| decode tokens/s | 16.0 <!-- fig: run.json median(rounds.*.hf) %.1f --> | 172.4 <!-- fig: run.json median(rounds.*.tps) %.1f --> |
| ratio | | 10.8x <!-- fig: run.json median(rounds.*.tps)/median(rounds.*.hf) %.1fx --> |

KL 0.0051 <!-- fig: run.json quality.kl %.4f -->, a share of 63% <!-- fig: run.json share {:.0%} -->, and a
file of 94 MB <!-- fig: - the size of the shipped file -->.

An example run printed:

```
decode tokens/s    22.6    174.6    7.72x
```
"""


@pytest.fixture
def sample(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for name, data in _RESULTS.items():
        (results / name).write_text(json.dumps(data))
    page = tmp_path / "sample.md"
    page.write_text(_PAGE)
    return page, results


def test_markers_parse_and_match(sample):
    page, results = sample
    found = markers(page)
    assert len(found) == 8 and sum(m.unbacked for m in found) == 1
    for m in found:
        check(m, results)
    assert [expected(m, results) for m in found if not m.unbacked][:2] == ["7.72x", "97.4 MiB"]
    assert unmarked(page) == []


@pytest.mark.parametrize(("shown", "why"), [
    ("7.73x <!-- fig: run.json ratios.decode_tokens_per_s %.2fx -->", "the file gives '7.72x'"),
    ("17.72x <!-- fig: run.json ratios.decode_tokens_per_s %.2fx -->", "the file gives '7.72x'"),
    ("7.72x <!-- fig: gone.json ratios.decode_tokens_per_s %.2fx -->", "no results file"),
    ("7.72x <!-- fig: run.json ratios.decode %.2fx -->", "no key 'decode'"),
    ("7.72x <!-- fig: run.json ratios.decode_tokens_per_s -->", "needs FILE VALUE FORMAT"),
    ("172.4 <!-- fig: run.json rounds.*.tps %.1f -->", "names several values"),
    ("94 MB <!-- fig: - -->", "must say where"),
])
def test_a_figure_that_drifted_from_its_file_fails(sample, shown, why):
    """A figure edited by hand, a file renamed, a key that moved: each is reported with what the file gives."""
    page, results = sample
    page.write_text(f"# Sample\n\nDecode went {shown} faster.\n")
    (m,) = markers(page)
    with pytest.raises(FigureError, match=why):
        check(m, results)


def test_a_changed_results_file_fails(sample):
    """The other way round: the page stays, a re-measured file gives another value."""
    page, results = sample
    data = dict(_RESULTS["run.json"], ratios={"decode_tokens_per_s": 7.25})
    (results / "run.json").write_text(json.dumps(data))
    failures = []
    for m in markers(page):
        try:
            check(m, results)
        except FigureError as e:
            failures.append(str(e))
    assert len(failures) == 1 and "'7.25x'" in failures[0] and "sample.md:L3" in failures[0]


def test_unmarked_figures_are_found_outside_example_output(tmp_path):
    page = tmp_path / "sample.md"
    page.write_text("""# Sample

Decode went 7.72x faster at 172.4 tokens/s, KL 0.0031; the 2-core machine of 2026-11-27.

| | plain | optimized |
|---|---|---|
| weights, MiB | 513.1 | 97.4 <!-- fig: - one-off --> |

A table from the demo:

```
decode tokens/s    22.6    174.6    7.72x
```

An example run printed:

```
decode tokens/s    22.6    174.6    7.72x
```

### A dated section

Decode went 6.1x faster.
""")
    assert [u.split(": ", 1)[1] for u in unmarked(page, "### ")] == [
        "7.72x", "172.4 tokens/s", "KL 0.0031", "513.1", "7.72x"]
    assert unmarked(page)[-1].endswith("6.1x")


def test_a_marker_shown_as_inline_code_is_no_marker(tmp_path):
    page = tmp_path / "sample.md"
    page.write_text("Write `1.42x <!-- fig: run.json ratios.x %.2fx -->` after a figure.\n")
    assert markers(page) == []


def test_a_marker_inside_a_code_block_is_refused(tmp_path):
    page = tmp_path / "sample.md"
    page.write_text("```\n7.72x <!-- fig: run.json ratios.decode_tokens_per_s %.2fx -->\n```\n")
    (m,) = markers(page)
    with pytest.raises(FigureError, match="inside a code block"):
        check(m)
