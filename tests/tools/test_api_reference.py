"""The API reference (issue 26) documents every public name under its public import path.

The site is built once with ``mkdocs build --strict`` (as CI does); then the generated pages are
read: no heading or anchor names an internal module (``cudnn_attn.compat.natten.ops``,
``cudnn_attn.verify.selftest``), every name of the public modules' ``__all__`` has its heading, and
the ops built at import time (``cudnn_attn.ops.na2d_forward``) show their real signatures. The
public aliases the pages rely on are checked at runtime too (the same module objects)."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cudnn_attn

ROOT = Path(__file__).resolve().parents[2]
# Packages under cudnn_attn that are implementation, never a public path of the reference.
INTERNAL = ("compat", "verify", "core", "model", "packed", "rewrites", "tracing", "torch_engine",
            "fallback_kernels", "cli")
INTERNAL_PATH = re.compile(r"\bcudnn_attn\.(?:%s)\b" % "|".join(INTERNAL))
HEADING = re.compile(r"<h([1-6])\b[^>]*\bid=\"([^\"]*)\"[^>]*>(.*?)</h\1>", re.S)
SIGNATURE = re.compile(r"<div class=\"doc-signature[^\"]*\"[^>]*>(.*?)</div>", re.S)


def text(fragment: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stderr[-4000:]}"
    return out


def api_pages(site: Path) -> dict[str, str]:
    pages = {p.parent.name: p.read_text(encoding="utf-8")
             for p in sorted((site / "api").glob("*/index.html"))}
    assert len(pages) == len(list((ROOT / "docs" / "api").glob("*.md")))
    return pages


def headings(page: str) -> list[tuple[str, str]]:
    """``(anchor, visible text)`` of every heading of a page."""
    return [(anchor, text(inner)) for _, anchor, inner in HEADING.findall(page)]


def test_the_pages_document_public_paths_only():
    """The ``:::`` identifiers of docs/api themselves (before any rendering)."""
    for page in sorted((ROOT / "docs" / "api").glob("*.md")):
        for identifier in re.findall(r"^::: *(\S+)", page.read_text(), re.M):
            assert not INTERNAL_PATH.search(identifier), f"{page.name}: ::: {identifier}"


def test_no_heading_or_anchor_names_an_internal_module(site):
    for name, page in api_pages(site).items():
        found = headings(page)
        assert found, name
        internal = [(anchor, title) for anchor, title in found
                    if INTERNAL_PATH.search(anchor) or INTERNAL_PATH.search(title)]
        assert not internal, f"api/{name}: {internal}"
        toc_links = re.findall(r"href=\"#([^\"]+)\"", page)
        assert not [a for a in toc_links if INTERNAL_PATH.search(a)], f"api/{name}"


@pytest.mark.parametrize("module, page", [("cudnn_attn", None), ("cudnn_attn.ops", "ops"),
                                          ("cudnn_attn.nn", "nn"),
                                          ("cudnn_attn.flash_attn_interface",
                                           "flash_attn_interface"),
                                          ("cudnn_attn.flash_api", "flash_api"),
                                          ("cudnn_attn.distributed", "distributed"),
                                          ("cudnn_attn.natten", "natten")])
def test_every_public_name_has_its_heading(site, module, page):
    import importlib

    # Underscore names (FlashAttention's ``_flash_attn_forward``, ...) are exported for the
    # clients of FA's private API and left out of the reference, as the pages' filter says.
    names = [n for n in importlib.import_module(module).__all__ if not n.startswith("_")]
    pages = api_pages(site)
    anchors = {a for p in ([pages[page]] if page else pages.values()) for a, _ in headings(p)}
    missing = [n for n in names if f"{module}.{n}" not in anchors]
    assert not missing, f"{module}: no heading for {missing}"


def test_generated_ops_show_their_signatures(site):
    page = api_pages(site)["ops"]
    signatures = [text(s) for s in SIGNATURE.findall(page)]
    na2d = [s for s in signatures if s.startswith("na2d_forward(")]
    assert len(na2d) == 1, signatures[:3]
    for parameter in ("output: Tensor", "kernel_size: int | Sequence[int]",
                      "attn_scale: float | None", "query_tile_size: int | Sequence[int] | None"):
        assert parameter in na2d[0], na2d[0]
    assert "rank" not in na2d[0]  # fixed by the rank wrapper
    selftest = [text(s) for s in SIGNATURE.findall(api_pages(site)["cudnn_attn"])
                if text(s).startswith("selftest(")]
    assert len(selftest) == 1 and "quick: bool = True" in selftest[0], selftest


def section(page: str, anchor: str) -> str:
    """The text from heading ``anchor`` to the next heading of its level or above."""
    start = page.index(f'id="{anchor}"')
    level = page.rfind("<h", 0, start)
    end = re.search(rf"<h[1-{page[level + 2]}]\b", page[start:])
    return text(page[start:start + end.start()] if end else page[start:])


def test_docstrings_written_at_import_time_are_rendered(site):
    """NATTEN's ``na1d/na2d/na3d`` share one docstring filled in per rank when the module loads,
    and the modules' ``__doc__`` is built from their base's: the reference shows both."""
    page = api_pages(site)["natten"]
    assert "2-D neighborhood attention (NATTEN 0.21 na2d" in section(page, "cudnn_attn.natten.na2d")
    assert "2-D Neighborhood self-attention layer" in \
        section(page, "cudnn_attn.natten.NeighborhoodAttention2D")


def test_the_public_aliases_are_the_internal_modules_and_functions():
    import cudnn_attn.ops
    import cudnn_attn.verify

    assert cudnn_attn.ops is sys.modules["cudnn_attn.compat.natten.ops"]
    assert cudnn_attn.selftest is cudnn_attn.verify.selftest
