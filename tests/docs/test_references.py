"""What the README and the docs name exists: `rlfabric` commands and their options, make targets, config keys,
repository files, and the pages, files and sections links point at. A renamed command, key or file fails here
with the page and the name (the issue found `rlfabric prepare-data`, a cited section that did not exist, and a
link to an issue tracker outside the repository)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import yaml
from markdown.extensions.toc import slugify

from rlfabric.cli.args import build_parser
from rlfabric.core.config import RunConfig, config_reference

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
REPO_DIRS = ("services", "tests", "bench", "examples", "docs", "helm", "protos", "docker")
SECTIONS = set(RunConfig.model_fields)
# Dotted names that start like a config key and are something else.
NOT_CONFIG_KEYS = {"server.address",  # OpenTelemetry's attribute of a client span
                   # bench/figures.py's figure names, which start like the judge section
                   "judge.tiny.batched_vs_unbatched", "judge.smollm2.batched_vs_unbatched"}
FILE_SUFFIXES = ("json", "proto", "py", "yaml", "yml", "md", "png", "txt", "log", "jsonl", "parquet")
# A key quoted right after these words is another project's name for it ("VeRL's `model.lora_rank`").
OTHER_PROJECTS = re.compile(r"(VeRL|TRL)(?:'s|:)?\s*$")


def ignored(path: str) -> bool:
    """Under a folder .gitignore anchors at the root (build outputs such as bench/results/gpu-logs/)."""
    prefixes = [line.strip("/") for line in (ROOT / ".gitignore").read_text().splitlines() if line.startswith("/")]
    return any(path.startswith(prefix) for prefix in prefixes)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def code_of(text: str) -> tuple[list[str], list[tuple[str, str]]]:
    """(inline code spans, fenced blocks as (language, body)) of a markdown page; spans that quote another
    project's names are left out."""
    blocks = [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```", text, re.M | re.S)]
    prose = other_projects_columns_dropped(re.sub(r"^```.*?^```", "", text, flags=re.M | re.S))
    spans = [m.group(1) for m in re.finditer(r"`([^`\n]+)`", prose)
             if not OTHER_PROJECTS.search(prose[max(0, m.start() - 12):m.start()])]
    return spans, blocks


def other_projects_columns_dropped(prose: str) -> str:
    """The page with the cells of table columns headed by another project's name ("VeRL key", "TRL
    `GRPOConfig`") emptied: those cells hold that project's names, not rlfabric's."""
    lines, foreign = prose.splitlines(), set()
    for i, line in enumerate(lines):
        if not line.startswith("|"):
            foreign = set()
            continue
        cells = line.strip().strip("|").split("|")
        if i + 1 < len(lines) and re.fullmatch(r"\|?[\s:|-]+\|?", lines[i + 1]) and not foreign:  # a header row
            foreign = {n for n, cell in enumerate(cells) if re.search(r"\b(VeRL|TRL)\b", cell) and "rlfabric" not in cell}
        elif foreign:
            lines[i] = "|".join("" if n in foreign else cell for n, cell in enumerate(cells))
    return "\n".join(lines)


def code_lines(text: str) -> list[str]:
    """Every inline code span and every line of a shell block: where commands and overrides are written."""
    spans, blocks = code_of(text)
    return spans + [line for lang, body in blocks if lang in ("bash", "sh", "shell", "") for line in body.splitlines()]


# --- commands and make targets -------------------------------------------------------------------------------

def subcommands() -> dict[str, set[str]]:
    """rlfabric's subcommands -> the options they (and their own subcommands) take."""
    parser = build_parser()
    choices = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices

    def options(sub: argparse.ArgumentParser) -> set[str]:
        found = {o for a in sub._actions for o in a.option_strings}
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                for nested in action.choices.values():
                    found |= options(nested)
        return found
    top = {o for a in parser._actions for o in a.option_strings}
    return {name: options(sub) | top for name, sub in choices.items()}


def make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z0-9_-]+):", (ROOT / "Makefile").read_text(), re.M))


def command_problems(page: Path, line: str, commands: dict[str, set[str]], targets: set[str]) -> list[str]:
    problems = []
    for match in re.finditer(r"(?:^|[\s(`$])rlfabric ([a-z][a-z-]*)(.*)", line):
        name, rest = match.group(1), re.split(r"#|\||;|&&|`", match.group(2))[0]
        if name not in commands:
            problems.append(f"{page.name}: `rlfabric {name}`: no such command ({', '.join(commands)})")
            continue
        problems += [f"{page.name}: `rlfabric {name} {flag}`: no such option"
                     for flag in re.findall(r"(?<!\S)(--[a-z][a-z-]*)", rest) if flag not in commands[name]]
    for match in re.finditer(r"(?:^|[\s(`])make ((?:[A-Z_]+=\S+ )*)([a-z][a-z-]*)", line):
        if match.group(2) not in targets:
            problems.append(f"{page.name}: `make {match.group(2)}`: no such target")
    return problems


def test_commands_and_make_targets_exist():
    commands, targets = subcommands(), make_targets()
    problems = [problem for page in pages() for line in code_lines(page.read_text())
                for problem in command_problems(page, line, commands, targets)]
    assert not problems, "\n".join(problems)


def test_a_stale_command_is_caught():
    commands, targets = subcommands(), make_targets()
    assert command_problems(Path("x.md"), "rlfabric prepare-data gsm8k", commands, targets)
    assert command_problems(Path("x.md"), "rlfabric train --no-such-flag", commands, targets)
    assert command_problems(Path("x.md"), "make no-such-target", commands, targets)
    assert not command_problems(Path("x.md"), "rlfabric data gsm8k --input a --out b  # ok", commands, targets)


# --- config keys ---------------------------------------------------------------------------------------------

def key_pattern(key: str) -> re.Pattern:
    """A dotted key as the docs write it: `<role>` for one part, `*` for any rest, `{a,b}` for either."""
    pattern = re.escape(key).replace(r"\*", ".*")
    pattern = re.sub(r"<[^>]*>", r"[^.]+", pattern.replace(r"\<", "<").replace(r"\>", ">"))
    pattern = re.sub(r"\\\{([^}]*)\\\}", lambda m: "(?:" + "|".join(m.group(1).split(",")) + ")", pattern)
    return re.compile(pattern + r"(?:\..+)?")  # a section or subsection names the keys under it


def known_key(key: str, keys: list[str]) -> bool:
    """The key, or a section above keys, matches a config key; `<name>` in either stands for any part."""
    pattern = key_pattern(key)
    return key in NOT_CONFIG_KEYS or any(pattern.fullmatch(known) or key_pattern(known).fullmatch(key)
                                         for known in keys)


def named_keys(text: str) -> list[str]:
    """Dotted config keys in code spans, shell lines (`key=value` overrides) and YAML blocks of a page."""
    found = []
    for token in (t for line in code_lines(text) for t in line.split()):
        match = re.fullmatch(r"([a-z_]+(?:\.[a-z0-9_<>*{},]+)+)(?:=.*)?[,;:.)]*", token.strip("`'\"(["))
        if match and match.group(1).split(".")[0] in SECTIONS and match.group(1).split(".")[-1] not in FILE_SUFFIXES:
            found.append(match.group(1).rstrip(".,"))
    for lang, body in code_of(text)[1]:
        if lang in ("yaml", "yml"):
            found += [key for key in flatten(yaml.safe_load(body)) if key.split(".")[0] in SECTIONS]
    return found


def flatten(value, prefix: str = "") -> list[str]:
    if not isinstance(value, dict) or not value:
        return [prefix[:-1]] if prefix else []
    return [key for name, item in value.items() for key in flatten(item, f"{prefix}{name}.")]


def test_config_keys_exist():
    keys = [key for key, _, _ in config_reference()]
    problems = [f"{page.relative_to(ROOT)}: `{key}` is no config key" for page in pages()
                for key in named_keys(page.read_text()) if not known_key(key, keys)]
    assert not problems, "\n".join(sorted(set(problems)))


def test_a_renamed_key_is_caught():
    keys = [key for key, _, _ in config_reference()]
    assert not known_key("trainer.total_epochs", keys)
    assert not known_key("actor.learning_rate", keys)
    assert all(known_key(key, keys) for key in ("actor.lr", "rollout.multi_turn", "launcher.ray.<role>.num_cpus",
                                                "rollout.val_*", "resource_pools.<pool>.nodes"))
    assert named_keys("run `rlfabric train trainer.total_steps=2 actor.lr=1e-5`") == ["trainer.total_steps", "actor.lr"]
    assert named_keys("```yaml\nactor:\n  lr: 1.0e-4\n  lora: {rank: 8}\n```\n") == ["actor.lr", "actor.lora.rank"]
    assert named_keys("VeRL's `model.lora_rank`, the file `reward.json`") == []
    table = "| VeRL key | rlfabric key |\n| --- | --- |\n| `trainer.total_epochs` | `trainer.total_steps` |\n"
    assert named_keys(table) == ["trainer.total_steps"]


# --- files and links -----------------------------------------------------------------------------------------

def named_paths(text: str) -> list[str]:
    """Repository paths in code spans and shell lines: `services/...`, `docs/...`, and so on."""
    paths = []
    for token in (t for line in code_lines(text) for t in line.split()):
        token = token.strip("`'\"(),;:")
        token = re.sub(r"(::|:)[\w\[\]-]*$", "", token)  # a test id or a line number
        if token.split("/")[0] in REPO_DIRS and "/" in token and not re.search(r"[<{…]|\.\.\.", token):
            paths.append(token)
    return paths


def test_named_files_exist():
    problems = [f"{page.relative_to(ROOT)}: `{path}` does not exist" for page in pages()
                for path in named_paths(page.read_text()) if not list(ROOT.glob(path.rstrip("/"))) and not ignored(path)]
    assert not problems, "\n".join(sorted(set(problems)))


def anchors(page: Path) -> set[str]:
    text = page.read_text()
    headings = re.findall(r"^#+ (.+?)\s*$", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S), re.M)
    return {slugify(re.sub(r"[`*]", "", h), "-") for h in headings} | set(re.findall(r'id="([^"]+)"', text))


def link_problems(page: Path) -> list[str]:
    problems = []
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        path, _, anchor = target.partition("#")
        base = DOCS if page.parent == DOCS / "generated" else page.parent  # snippets resolve where included
        resolved = (base / path).resolve() if path else page
        if not resolved.exists():
            problems.append(f"{page.relative_to(ROOT)}: link to {target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{page.relative_to(ROOT)}: link to {target}: no such section")
    return problems


def test_links_reach_files_and_sections():
    problems = [problem for page in pages() for problem in link_problems(page)]
    assert not problems, "\n".join(problems)


def test_cited_readme_sections_exist():
    """`README, "Section"` in a page or an example's comment names a heading the README has."""
    readme = anchors(ROOT / "README.md")
    sources = pages() + sorted((ROOT / "examples").glob("*.yaml"))
    problems = [f"{source.relative_to(ROOT)}: README section {title!r} does not exist" for source in sources
                for title in re.findall(r'README,? "([^"]+)"', source.read_text())
                if slugify(title, "-") not in readme]
    assert not problems, "\n".join(problems)


def test_examples_name_existing_docs():
    sources = sorted((ROOT / "examples").glob("*.yaml")) + [ROOT / "services" / "quickstart" / "quickstart.yaml"]
    problems = [f"{source.relative_to(ROOT)}: {path} does not exist" for source in sources
                for path in re.findall(r"\b(docs/[\w./-]+\w/?)", source.read_text()) if not (ROOT / path).exists()]
    assert not problems, "\n".join(problems)
