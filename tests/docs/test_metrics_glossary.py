"""docs/metrics.md against the metric names the code emits: every name the glossary lists is written somewhere
in services/ (whole, or its prefix and last part for the names a role or a statistic completes), and every
whole metric name the code writes as a string is in the glossary."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAMESPACES = ("actor", "critic", "timing_s", "perf", "rollout", "rollout_corr", "reward", "dynamic_sampling",
              "response_length", "prompt_length", "weight_sync", "memory", "val-core", "agent",
              "distill")
STATISTICS = ("mean", "max", "min")


def code() -> str:
    return "\n".join(path.read_text() for path in (ROOT / "services").rglob("*.py") if "v1" not in path.parts)


def glossary_names() -> list[str]:
    """Every name of the glossary's first column, `{a,b}` expanded (`<x>` kept)."""
    names = []
    for row in re.findall(r"^\| (.+?) \|", (ROOT / "docs" / "metrics.md").read_text(), re.M):
        for name in re.findall(r"`([^`]+)`", row):
            names += expand(name)
    return names


def expand(name: str) -> list[str]:
    match = re.search(r"\{([^}]*)\}", name)
    if not match:
        return [name]
    return [full for part in match.group(1).split(",")
            for full in expand(name[:match.start()] + part + name[match.end():])]


def emitted(name: str, source: str) -> bool:
    """Whether the code writes this name: whole, as a prefix the statistics complete (`critic/score` ->
    `critic/score/mean`), as a role's metric (`{self.role}/grad_norm`), or up to its first `<x>`."""
    if "<" in name:
        prefix = name[:name.index("<")]
        return f'"{prefix}' in source or re.search(re.escape(prefix[: prefix.rindex("/", 0, -1) + 1]) + r"\{", source)
    stem = name.rsplit("/", 1)[0] if name.rsplit("/", 1)[-1] in STATISTICS else name
    namespace, last = stem.split("/", 1)[0], stem.rsplit("/", 1)[-1]
    return (f'"{name}"' in source or f'"{stem}"' in source or f'"{stem}/' in source
            or f'{{self.role}}/{last}"' in source
            or (f'"{last}"' in source and (f'"{namespace}/' in source or "{self.role}/" in source)))


def test_every_glossary_name_is_emitted():
    source = code()
    missing = [name for name in glossary_names() if not emitted(name, source)]
    assert not missing, f"docs/metrics.md lists names no code writes: {missing}"


def test_every_emitted_name_is_in_the_glossary():
    pattern = r'"((?:' + "|".join(NAMESPACES) + r')/[a-z0-9_/@.]+)"'
    written = {name for name in re.findall(pattern, code()) if not name.endswith((".py", "/"))}
    assert len(written) > 40, "the pattern finds the metric names the code writes"
    listed = glossary_names()
    regexes = [re.compile(re.sub(r"<[^>]+>", r"[^/]+", re.escape(n).replace(r"\<", "<").replace(r"\>", ">")))
               for n in listed]
    missing = sorted(name for name in written
                     if not any(regex.fullmatch(name) or regex.fullmatch(f"{name}/mean") for regex in regexes))
    assert not missing, f"metrics the code writes that docs/metrics.md does not list: {missing}"


def test_a_metric_missing_from_the_code_is_caught():
    assert not emitted("actor/no_such_metric", code())
    assert emitted("critic/score/mean", code()) and emitted("timing_s/update_weights/<phase>", code())
