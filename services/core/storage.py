"""The storage root: where paths that arrive over RPC may point.

    storage = StorageRoot.from_config(config)
    path = storage.resolve(request.path, "ExportHF path")   # PermissionDenied outside the root

A caller holding the token still must not make a service read or write anywhere its uid can: an
ExportHF to "~/projects" or "../../etc" is refused, not attempted. Paths are resolved with symlinks
followed, so a link inside the root that points out of it is refused too. What this cannot stop: a
symlink created under the root between the check and the write by someone who can write there.

fsync and fsync_tree: what the services write (checkpoints, exports) reaches the disk before it is
renamed into place. create_private_file: a new file only this user can read (tokens, staged weights).
disk_full: the RESOURCE_EXHAUSTED for a write that failed because the disk is full, whatever the writer
said (torch.save says "unexpected pos 576 vs 534").
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from rlfabric.core.config import RunConfig
from rlfabric.core.errors import InvalidArgument, PermissionDenied, ResourceExhausted

# Below this many free bytes after a failed write, the disk is taken to be what failed it.
LOW_SPACE_BYTES = 1 << 20
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class StorageRoot:
    """A directory that RPC-supplied paths must resolve into (config storage.root)."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()

    @classmethod
    def from_config(cls, config: RunConfig) -> StorageRoot:
        return cls(config.storage.resolved_root(config.trainer.run_dir))

    def resolve(self, path: str | Path, what: str) -> Path:
        """The absolute, symlink-free form of path (relative paths start at the root), or PermissionDenied
        naming the root when it lies outside."""
        if not str(path):
            raise InvalidArgument(f"{what} is empty")
        if "\x00" in str(path):  # no file name holds one; os calls raise ValueError
            raise InvalidArgument(f"{what} {str(path)!r} contains a NUL byte")
        resolved = (self.root / path).resolve()
        if resolved != self.root and self.root not in resolved.parents:
            raise PermissionDenied(f"{what} {str(path)!r} resolves to {resolved}, outside the storage root "
                                   f"{self.root} (storage.root): services read and write only under it")
        return resolved


def fsync(path: Path) -> None:
    """Flushes a file's or a directory's entries to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync of every file and directory below root, then root: so that what was written
    there is on disk before it is renamed into place."""
    for directory, _, names in os.walk(root, topdown=False):
        for name in names:
            fsync(Path(directory) / name)
        fsync(Path(directory))


def create_private_file(path: Path, text: str = "") -> Path:
    """Creates path (mode 0600) holding text. O_EXCL: never through a file or link someone placed there
    first; an existing path is FileExistsError."""
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
        file.write(text)
    return path


def out_of_space(error: BaseException) -> bool:
    """error, or one it was raised from, says the disk (or the user's quota) is full: an OSError ENOSPC or
    EDQUOT, or a message holding its text (safetensors: "No space left on device (os error 28)")."""
    texts = [os.strerror(code) for code in _NO_SPACE]
    while error is not None:
        if (isinstance(error, OSError) and error.errno in _NO_SPACE) or any(text in str(error) for text in texts):
            return True
        error = error.__cause__ or error.__context__
    return False


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged user may still write on the filesystem holding path (or its nearest parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def disk_full(path: Path, error: BaseException) -> ResourceExhausted | None:
    """The error to raise for `error`, which a write under path failed with, when the disk is full: the error
    says so, or it does not but the filesystem has (almost) nothing left. None otherwise. Call it before the
    partial write is removed, while its bytes still fill the disk."""
    try:
        free = free_bytes(path)
    except OSError:
        return None
    if not out_of_space(error) and free >= LOW_SPACE_BYTES:
        return None
    return ResourceExhausted(f"cannot write {path}: the disk holding it is full ({free} bytes free; "
                             f"{type(error).__name__}: {error}): free space there or write elsewhere")
