"""The docs site builds (`mkdocs build --strict`) and shows what the code does today.

The site is built once per session; without mkdocs (the `docs` extra) the build tests are skipped.
The checks of pages against today's outputs (README's trace, the head-parallel ranks) need no build.
"""

import html
import importlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from shapesafe_mha import TraceConfig, trace_forward
from shapesafe_mha._core import dims as _dims
from shapesafe_mha._tools.cli import render
from tools.pictures import PICTURES

ROOT = Path(__file__).resolve().parent.parent
NAMESPACES = ("shapesafe_mha", "shapesafe_mha.testing", "shapesafe_mha.parallel", "shapesafe_mha.reference")
BOX = re.compile("[┏┓┗┛┃━┡┩╇┳┻│─└┘┌┐├┤┼]")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as `mkdocs build --strict` writes it (a warning fails the build)."""
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
    pytest.importorskip("mkdocstrings_handlers.python", reason="the docs extra is not installed")
    out = tmp_path_factory.mktemp("site")
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(out)]
    env = os.environ | {"NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    return out


def _page(site: Path, name: str) -> str:
    return (site / name / "index.html").read_text() if name else (site / "index.html").read_text()


def _all_html(site: Path) -> str:
    return "\n".join(p.read_text() for p in site.rglob("*.html"))


def _first_nav_entry() -> str:
    text = (ROOT / "mkdocs.yml").read_text()
    return text[text.index("\nnav:\n") :].splitlines()[2].strip()


def test_landing_page_comes_first_with_the_example_and_the_stages_picture(site: Path) -> None:
    """index.md is the first page of the nav; its page has the runnable example and the stages picture."""
    assert _first_nav_entry() == "- Home: index.md"
    html = _page(site, "")
    assert "In 30 seconds" in html
    assert "MultiHeadAttention" in html and "ShapeError" in html
    assert 'src="stages.svg"' in html
    assert (site / "stages.svg").read_text() == PICTURES["stages.svg"]()


def test_landing_page_shows_the_message_its_example_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """The text block under the 30-second example is what the example prints today."""
    page = (ROOT / "docs" / "index.md").read_text()
    code, shown = re.search(r"```python\n(.*?)```.*?```text\n(.*?)```", page, re.DOTALL).groups()  # type: ignore[union-attr]
    exec(compile(code, "index.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert shown.strip() in printed


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_every_public_name_is_in_the_reference_with_its_signature(site: Path, namespace: str) -> None:
    """Each name in the namespace's __all__ has a heading in the built site; each callable, a signature."""
    html = _all_html(site)
    module = importlib.import_module(namespace)
    unsigned = []
    for name in module.__all__:
        anchor = f'id="{namespace}.{name}"'
        assert anchor in html, f"{namespace}.{name} is not in the API reference: does it have a docstring?"
        obj = getattr(module, name)
        if callable(obj) and not (isinstance(obj, type) and issubclass(obj, Exception)):  # errors are raised, not built
            section = html[html.index(anchor) :]
            body = section.index("</h")  # the signature follows its heading, before the next one
            section = section[: section.find('class="doc doc-heading"', body)]
            if "doc-signature" not in section:
                unsigned.append(name)
    assert not unsigned, f"no signature in the API reference for {unsigned}"


def test_dimensions_table_lists_every_declared_dimension(site: Path) -> None:
    """The API page's Dimensions table names every dimension in shapesafe_mha._core.dims.DIMS."""
    html = _page(site, "api")
    table = html[html.index('id="dimensions"') :]
    table = table[table.index("<table>") : table.index("</table>")]
    missing = [d for d in _dims.DIMS if f"<code>{d}</code>" not in table]
    assert not missing, f"the Dimensions table lacks {missing}: describe them in _dims.py's docstring table"


def test_the_dims_page_shows_every_alias_with_its_shape(site: Path) -> None:
    """Each alias `shapesafe_mha.dims` exports is on the dims page beside the named shape it stands for."""
    import shapesafe_mha.dims as public
    from shapesafe_mha._core.messages import arrays_of

    rows = [html.unescape(re.sub(r"<[^>]+>|\s+", " ", row)).split() for row in _page(site, "api-dims").split("<tr>")]
    for name in (n for n in public.__all__ if n != "DIMS"):
        row = " ".join(next((r for r in rows if r and r[0] == name), []))
        assert all(f'"{a.dim_str}"' in row for a in arrays_of(getattr(public, name))), (name, row)


def test_sitemap_lists_every_page_under_the_site_url(site: Path) -> None:
    """site_url is set, so sitemap.xml lists the pages (an empty sitemap means it is missing)."""
    sitemap = (site / "sitemap.xml").read_text()
    assert "<loc>https://shapesafe-mha.readthedocs.io/</loc>" in sitemap
    assert "<loc>https://shapesafe-mha.readthedocs.io/api/</loc>" in sitemap


def test_site_pictures_are_current(site: Path) -> None:
    """Every picture the site ships is the one tools/pictures.py draws from today's code."""
    for name, draw in PICTURES.items():
        assert (site / name).read_text() == draw(), f"{name} is stale: run python -m tools.pictures"


def test_text_blocks_wrap_and_code_blocks_can_be_copied(site: Path) -> None:
    """Error messages are text blocks styled to wrap; the theme offers a copy button on code."""
    css = (site / "stylesheets" / "extra.css").read_text()
    assert re.search(r"\.language-text pre > code \{[^}]*white-space: pre-wrap", css)
    errors = _page(site, "errors")
    assert "stylesheets/extra.css" in errors
    assert errors.count('class="language-text highlight"') >= 20
    assert '"content.code.copy"' in errors


def test_no_page_pastes_a_terminal_table() -> None:
    """Tables are markdown or plain text, never rich's box drawing pasted from a terminal."""
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        assert not BOX.search(page.read_text()), f"{page.name} has box-drawing characters"


def _row_cells(line: str) -> list[str]:
    return re.split(r"\s{2,}", line.strip())


def test_readme_trace_rows_are_what_trace_prints_today() -> None:
    """Each row of README's trace excerpt equals that stage's row in today's trace (in trace order)."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```text\n\$ shapesafe-mha trace (.*?)\n(.*?)```", readme, re.DOTALL)
    assert block is not None
    args = dict(zip(*[iter(block[1].split())] * 2, strict=True))
    config = TraceConfig(**{k.removeprefix("--").replace("-", "_"): int(v) for k, v in args.items()})  # type: ignore[arg-type]
    header, *rows = block[2].strip("\n").splitlines()
    assert _row_cells(header) == ["stage", "named shape", "shape", "strides", "storage"]
    traced = {}
    for s in trace_forward(config).stages:
        storage = s.storage
        traced[s.name] = [s.name, s.named_shape, str(tuple(s.shape)), str(tuple(s.strides)), storage]
    shown = [_row_cells(row) for row in rows]
    for cells in shown:
        today = traced.get(cells[0])
        assert cells == today, f"README's trace row for {cells[0]} is stale: today {today}"
    order = list(traced)
    assert [order.index(c[0]) for c in shown] == sorted(order.index(c[0]) for c in shown)


def test_parallel_page_shows_what_trace_tp_4_prints_today() -> None:
    """docs/parallel.md's rank table and totals are those of `shapesafe-mha trace --tp 4` now."""
    console = Console(record=True, width=400, file=io.StringIO())
    render(trace_forward(TraceConfig(tp=4)), console)
    printed = console.export_text()
    page = (ROOT / "docs" / "parallel.md").read_text()
    for r in trace_forward(TraceConfig(tp=4)).totals["ranks"]:
        line = next(x for x in printed.splitlines() if re.match(rf"│\s+{r['rank']} │", x))
        cells = [c.strip() for c in line.strip("│").split("│")]
        assert "| " + " | ".join(cells) + " |" in page, f"rank {r['rank']}: {cells} is not in parallel.md"
    for prefix in ("each forward all-reduces", "allocated during the forward"):
        line = next(x for x in printed.splitlines() if x.startswith(prefix))
        assert line in page, f"parallel.md is stale: today {line!r}"


# In headless Chromium, every page of the built site at a phone's width and at a laptop's: each page
# in an iframe of that width inside one harness page (one browser start for all), measured by script.
MEASURE = """
const results = [];
let pending = PAGES.length * WIDTHS.length;
function measure(doc, page, width) {
  const code = [...doc.querySelectorAll(".md-typeset pre > code")]
    .filter(c => c.scrollWidth > c.clientWidth + 1)
    .map(c => c.textContent.split("\\n").reduce((a, b) => (b.length > a.length ? b : a), ""));
  const images = [...doc.querySelectorAll(".md-typeset img")].map(img => ({
    src: img.currentSrc.split("/").pop(), shown: img.getBoundingClientRect().width, natural: img.naturalWidth,
  }));
  results.push({page, width, code, images});
  if (--pending === 0) {
    const out = document.createElement("pre");
    out.id = "measured";
    out.textContent = JSON.stringify(results);
    document.body.appendChild(out);
  }
}
for (const width of WIDTHS) for (const page of PAGES) {
  const frame = document.createElement("iframe");
  frame.style.width = width + "px";
  frame.style.height = "900px";
  frame.onload = () => measure(frame.contentDocument, page, width);
  frame.src = page;
  document.body.appendChild(frame);
}
"""
PHONE, LAPTOP = 400, 1280
SVG_TEXT_PX = 12  # the smallest text our pictures draw (tools/pictures.py, shapesafe_mha/_tools/svg.py)


def _chromium() -> str | None:
    names = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome", "chrome-headless-shell")
    return next((found for found in map(shutil.which, names) if found), None)


@pytest.fixture(scope="module")
def measured(site: Path) -> list[dict]:  # type: ignore[type-arg]
    """What Chromium lays out on each page at 400 and 1280 px: code blocks that overflow, each picture's scale."""
    browser = _chromium()
    if browser is None:
        message = "no Chromium to lay the site out (Debian: apt-get install chromium)"
        if os.environ.get("SHAPESAFE_REQUIRE_CHROMIUM"):  # .ci/run: the layout must be checked, not skipped
            pytest.fail(message)
        pytest.skip(message)
    pages = sorted(str(p.relative_to(site)) for p in site.rglob("index.html") if "search" not in p.parts)
    script = f"const PAGES = {json.dumps(pages)}, WIDTHS = [{PHONE}, {LAPTOP}];\n{MEASURE}"
    harness = site / "measure-harness.html"
    harness.write_text(f"<!doctype html><html><body><script>{script}</script></body></html>")
    # No network: the theme's web fonts would wait for DNS on every page (39 s, not 4). The fallback
    # monospace is what an offline reader sees, as wide a character as the theme's Roboto Mono (0.6 em).
    command = [
        browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--allow-file-access-from-files",
        "--host-resolver-rules=MAP * ~NOTFOUND", "--dump-dom", harness.as_uri(),
    ]  # fmt: skip
    dom = subprocess.run(command, capture_output=True, text=True, timeout=300).stdout
    found = re.search(r'<pre id="measured">(.*?)</pre>', dom, re.DOTALL)
    assert found, f"Chromium measured nothing:\n{dom[-2000:]}"
    return json.loads(html.unescape(found[1]))


def test_no_code_block_is_cut_at_a_laptops_width(measured: list[dict]) -> None:  # type: ignore[type-arg]
    """At 1280 px every code line fits its block or wraps under itself (extra.css); none runs under the edge."""
    cut = {r["page"]: r["code"] for r in measured if r["width"] == LAPTOP and r["code"]}
    assert not cut, f"code cut at {LAPTOP} px (longest line of each block): {cut}"


@pytest.mark.parametrize("width", [PHONE, LAPTOP])
def test_the_stages_picture_is_legible_at_a_phones_and_a_laptops_width(measured: list[dict], width: int) -> None:  # type: ignore[type-arg]
    """The landing page's stages picture: the one-column drawing on a phone, its text at 10 px or more."""
    landing = next(r for r in measured if r["page"] == "index.html" and r["width"] == width)
    picture = next(i for i in landing["images"] if i["src"].startswith("stages"))
    assert picture["src"] == ("stages-narrow.svg" if width == PHONE else "stages.svg")
    scale = picture["shown"] / picture["natural"]
    assert SVG_TEXT_PX * scale >= 10, f"{picture['src']} shown at {scale:.0%}: its text is {SVG_TEXT_PX * scale:.1f} px"
