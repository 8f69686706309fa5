"""mkdocs hooks (mkdocs.yml loads this file): text that the docs take from the code, not from a copy.

`<!-- dimensions -->` on a page becomes the notation table of `shapesafe_mha._core.dims`, the one place
where every dimension name is declared, so the API page lists exactly the names the code knows.
"""

from typing import Any

MARKER = "<!-- dimensions -->"


def dimensions_table() -> str:
    """The markdown table in `shapesafe_mha._core.dims`'s docstring."""
    from shapesafe_mha._core import dims as _dims

    lines = [line for line in (_dims.__doc__ or "").splitlines() if line.startswith("|")]
    if not lines:
        raise ValueError("shapesafe_mha._core.dims's docstring has no notation table")
    return "\n".join(lines)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return markdown.replace(MARKER, dimensions_table()) if MARKER in markdown else markdown
