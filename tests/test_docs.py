"""Every Python snippet on the documentation site runs, and shows what it claims.

Each page's ```` ```python ```` blocks run in order in one namespace, so a page
reads top to bottom like a session. A block written as a doctest (``>>>``
lines) must print what it shows; any other block runs as a script whose
``assert`` statements state its results. An HTML comment on the line just
before a block changes that: ``<!-- requires: jax -->`` skips the block when
the module cannot be imported, ``<!-- not run: REASON -->`` never runs it (say,
a block that needs a GPU).
"""

from __future__ import annotations

import doctest
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
_BLOCK = re.compile(
    r"(?:<!--\s*(?P<directive>[\w ]+):\s*(?P<arg>[^>]*?)\s*-->\s*\n)?"
    r"^(?P<indent>[ \t]*)```python[^\n]*\n(?P<code>.*?)^(?P=indent)```",
    re.MULTILINE | re.DOTALL,
)
_FLAGS = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS

# torch's forward-mode AD scripts its decompositions on first use, which warns.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")


@dataclass(frozen=True)
class Snippet:
    page: str
    line: int
    code: str
    directive: str | None
    arg: str


def snippets(page: str) -> list[Snippet]:
    """The ```` ```python ```` blocks of ``page``, dedented, with their directives.

    Example:
        >>> first = snippets("contract.md")[0]
        >>> first.page, first.code.splitlines()[0]
        ('contract.md', 'import torch, fscan')
    """
    text = (DOCS / page).read_text()
    found = []
    for match in _BLOCK.finditer(text):
        indent = len(match["indent"])
        code = "".join(line[indent:] + "\n" for line in match["code"].splitlines())
        line = text.count("\n", 0, match.start("code")) + 1
        found.append(Snippet(page, line, code, match["directive"], match["arg"] or ""))
    return found


def run_snippet(snippet: Snippet, namespace: dict) -> None:
    """Run one block in ``namespace``: as a doctest if it has prompts, else as a script."""
    name = f"docs/{snippet.page}:{snippet.line}"
    if snippet.code.lstrip().startswith(">>>"):
        test = doctest.DocTestParser().get_doctest(snippet.code, namespace, name, name, 0)
        runner = doctest.DocTestRunner(optionflags=_FLAGS)
        report: list[str] = []
        runner.run(test, out=report.append, clear_globs=False)
        namespace.update(test.globs)  # the doctest ran on a copy of the namespace
        assert runner.failures == 0, f"{name}: doctest failed\n" + "".join(report)
    else:
        exec(compile(snippet.code, name, "exec"), namespace)


def skipped(snippet: Snippet) -> str | None:
    """Why ``snippet`` does not run here, or None when it does."""
    if snippet.directive == "not run":
        return snippet.arg
    if snippet.directive == "requires" and importlib.util.find_spec(snippet.arg) is None:
        return f"needs {snippet.arg}"
    if snippet.directive is not None and snippet.directive not in ("not run", "requires"):
        raise ValueError(f"docs/{snippet.page}:{snippet.line}: unknown directive {snippet}")
    return None


@pytest.mark.parametrize("page", PAGES)
def test_the_snippets_of_each_page_run(page):
    namespace: dict = {"__name__": f"docs_{Path(page).stem}"}
    for snippet in snippets(page):
        if skipped(snippet) is None:
            run_snippet(snippet, namespace)


def test_every_page_is_in_the_navigation():
    nav = (DOCS.parent / "mkdocs.yml").read_text()
    assert [page for page in PAGES if page not in nav] == []
