"""Docs that cannot go stale: every ```python block of README.md and docs/*.md runs (see tests/doc_blocks.py)."""

from __future__ import annotations

import contextlib
import os
import re
import traceback

import pytest

from .doc_blocks import ROOT, Block, python_blocks, run_block

BLOCKS = python_blocks()


class _Page:
    """One page's session: its namespace and how far its blocks have run."""

    def __init__(self, folder):
        self.folder = folder  # the working directory of the page's blocks
        self.namespace: dict = {}
        self.done: set[int] = set()
        self.failed: list[str] = []


_SESSIONS: dict[str, _Page] = {}


def _params():
    for block in BLOCKS:
        marks = []
        if block.marker == "real_model":
            marks.append(pytest.mark.real_model)
        if block.marker == "skip" and block.marker_error is None:
            marks.append(pytest.mark.skip(reason=f"{block.id}: {block.options['reason']}"))
        yield pytest.param(block, id=block.id, marks=marks)


@contextlib.contextmanager
def _cwd(folder: str):
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


def _catch_up(page: _Page, block: Block) -> None:
    """Run the page's earlier blocks that have not run yet (when a block is selected on its own)."""
    for earlier in BLOCKS:
        if earlier.page != block.page or earlier.line >= block.line or earlier.line in page.done:
            continue
        page.done.add(earlier.line)
        if earlier.marker in ("skip", "real_model") or earlier.marker_error:
            continue
        try:
            with _cwd(page.folder):
                run_block(earlier, page.namespace)
        except Exception:  # its own test reports it
            page.failed.append(earlier.id)


@pytest.mark.parametrize("block", list(_params()))
def test_doc_block(block: Block, tmp_path_factory):
    if block.marker_error:
        pytest.fail(f"{block.id}: {block.marker_error}", pytrace=False)
    if block.page not in _SESSIONS:
        _SESSIONS[block.page] = _Page(tmp_path_factory.mktemp(re.sub(r"\W", "-", block.page)))
    page = _SESSIONS[block.page]
    _catch_up(page, block)
    page.done.add(block.line)
    # a real_model block runs on a copy, so the blocks after it see the same namespace whether it ran or not
    namespace = dict(page.namespace) if block.marker == "real_model" else page.namespace
    earlier = list(page.failed)
    try:
        with _cwd(page.folder):
            run_block(block, namespace)
        return
    except Exception as err:
        if block.marker != "real_model":
            page.failed.append(block.id)
        message = f"{block.id} failed\n{_where(err, block)}{type(err).__name__}: {err}"
    if earlier:
        message += f"\n(earlier blocks of this page failed: {', '.join(earlier)})"
    pytest.fail(message, pytrace=False)


def _where(err: BaseException, block: Block) -> str:
    """The traceback lines inside the doc block (as page lines), then the innermost frame."""
    frames = traceback.extract_tb(err.__traceback__)
    code = block.code.splitlines()
    lines = [f"  {block.page}:L{block.line + f.lineno}: {code[f.lineno - 1].strip()}"
             for f in frames if f.filename == block.id and 0 < f.lineno <= len(code)]
    if frames and frames[-1].filename != block.id:
        lines.append(f"  {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}: {frames[-1].line}")
    return "\n".join(lines) + "\n" if lines else ""


def test_every_page_is_collected():
    """Each page with a python block is collected, and no fence is left unclosed (a silent non-block)."""
    pages = {b.page for b in BLOCKS}
    assert "README.md" in pages and "docs/getting-started.md" in pages
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        fences = [ln for ln in path.read_text().splitlines() if re.match(r"^\s*```", ln)]
        assert len(fences) % 2 == 0, f"{path.relative_to(ROOT)}: an unclosed ``` fence"
