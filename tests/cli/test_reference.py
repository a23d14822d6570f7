"""`rlfabric config-reference` (rlfabric.cli.reference): the docs site's configuration pages are its output of
today, one page per section with an anchor per key."""

from __future__ import annotations

from pathlib import Path

from rlfabric.cli.reference import config_reference_markdown, config_reference_pages
from rlfabric.core.config import config_reference

PAGES = Path(__file__).resolve().parents[2] / "docs" / "configuration"


def test_configuration_pages_are_current():
    pages = config_reference_pages()
    assert {path.name for path in PAGES.glob("*.md")} == set(pages), "run `make docs` to regenerate docs/configuration"
    for name, text in pages.items():
        assert (PAGES / name).read_text() == text, f"run `make docs` to regenerate docs/configuration/{name}"


def test_every_key_has_an_anchor_on_its_section_page():
    pages = config_reference_pages()
    for key, _, _ in config_reference():
        page = f"{key.split('.')[0]}.md" if "." in key or key == "resource_pools" else "index.md"
        assert f'<a id="{key}"></a>' in pages[page], key


def test_the_single_table_lists_every_key():
    table = config_reference_markdown()
    assert all(f"| `{key}` |" in table for key, _, _ in config_reference())
