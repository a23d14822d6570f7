"""`rlfabric config-reference` (rlfabric.cli.reference): docs/config-reference.md is its output of today."""

from __future__ import annotations

from pathlib import Path

from rlfabric.cli.reference import config_reference_markdown


def test_config_reference_doc_is_current():
    doc = Path(__file__).resolve().parents[2] / "docs" / "config-reference.md"
    assert doc.read_text() == config_reference_markdown(), "run `make docs` to regenerate docs/config-reference.md"
