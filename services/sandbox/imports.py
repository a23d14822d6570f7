"""Before a sandbox drops its privileges: import the installed modules the user's code names, since the
sandbox uid may not read the interpreter's own files."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os

# Codecs the standard library loads lazily behind the user's back (idna: any host name given to socket).
LAZY_STANDARD_MODULES = ("encodings.idna", "encodings.punycode", "encodings.unicode_escape", "encodings.latin_1")


def import_installed_modules(source: bytes, path: str) -> list[str]:
    """Imports the installed modules (standard library, site-packages) that the file's import statements
    name, before the sandbox drops privileges: the sandbox uid may not be able to read the interpreter's
    own files (e.g. Python under /root, mode 0700), and an import inside the sandbox would then fail.
    Never a module beside the user's file: that is user code, and runs only confined. Returns the names."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []  # load_function reports it, confined
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # submodules, if they are
    user_dir = os.path.dirname(os.path.abspath(path)) + os.sep
    imported = []
    for name in [*LAZY_STANDARD_MODULES, *sorted(names)]:
        try:
            spec = importlib.util.find_spec(name.split(".")[0])
        except (ImportError, ValueError):
            continue
        if spec is None:
            continue
        places = [spec.origin or "", *(spec.submodule_search_locations or ())]
        if any(place.startswith(user_dir) for place in places):
            continue
        try:
            importlib.import_module(name)
        except Exception:  # not a module (a function's name), or broken: the user's import says so, confined
            continue
        imported.append(name)
    return imported
