"""mkdocs hook: a config key quoted on a page (`actor.lr`) links to its row on the configuration pages
(configuration/actor.md#actor.lr), so every key a page names is one click from its default and meaning."""

from __future__ import annotations

import re

from rlfabric.core.config import config_reference

KEYS = {key for key, _, _ in config_reference() if "<" not in key}
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
SPAN = re.compile(r"(?<![\[`])`([a-z_]+(?:\.[a-z0-9_]+)+)`(?!\])")


def _link(match: re.Match, up: str) -> str:
    key = match.group(1)
    if key not in KEYS:
        return match.group(0)
    section = key.split(".")[0] if "." in key else "index"
    return f"[`{key}`]({up}configuration/{section}.md#{key})"


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri.startswith("configuration/"):
        return markdown  # the pages the links lead to
    up = "../" * page.file.src_uri.count("/")
    parts, last = [], 0
    for fence in FENCE.finditer(markdown):  # code blocks stay as they are
        parts.append(SPAN.sub(lambda m: _link(m, up), markdown[last:fence.start()]))
        parts.append(fence.group(0))
        last = fence.end()
    parts.append(SPAN.sub(lambda m: _link(m, up), markdown[last:]))
    return "".join(parts)
