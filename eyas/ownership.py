"""What eyas may touch: the directories it made, each marked as such, and one writer per directory at a time.

Every directory eyas creates as a command's or a stage's output (a run directory, RUN/prepared, a store,
a training run, eval results, an export) carries MARKER, a small JSON file naming eyas, the kind of output,
the marker's format version, the run (or command invocation) that made it and when. A directory without
it is the user's: eyas never writes into it unless it is empty, and never adopts, moves, replaces or
removes it. A writer holds an exclusive lock beside its output (`lock_file`) for as long as it writes; the
lock is released with the process, even on kill -9, records the holder's pid for the message a second
writer gets, and its file is removed when the writer ends. A stage that fails before writing anything leaves no
directory behind.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import uuid
from pathlib import Path
from typing import Iterator

from eyas.common import EyasError, atomic_write_json

MARKER = ".eyas.json"
FORMAT_VERSION = 1
LOCK_SUFFIX = ".eyas.lock"
_invocation: dict[str, str] = {}


def invocation_id() -> str:
    """A random id of this process's command, recorded by the outputs it creates outside a run."""
    return _invocation.setdefault("id", uuid.uuid4().hex)


def check_output_path(path: str | os.PathLike, what: str = "output directory") -> Path:
    """`path` as a Path, if it can be an output directory: not empty, not a symbolic link, not a file."""
    text = os.fspath(path)
    if text == "":
        raise EyasError(f"the {what} is an empty path, which would mean the current directory: name a directory")
    p = Path(text).expanduser()
    if p.is_symlink():
        raise EyasError(f"the {what} {p} is a symbolic link (to {os.path.realpath(p)}); eyas does not write "
                        f"through links: name the directory itself, or choose another one")
    if p.exists() and not p.is_dir():
        raise EyasError(f"the {what} {p} is an existing file, not a directory: choose another path")
    return p


def read_marker(path: str | os.PathLike) -> dict | None:
    """The marker of a directory eyas made, or None (no marker, not eyas's, unreadable, or reached by a link)."""
    p = Path(path)
    marker = p / MARKER
    if p.is_symlink() or marker.is_symlink() or not p.is_dir():
        return None
    try:
        doc = json.loads(marker.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("made_by") != "eyas" or not isinstance(doc.get("kind"), str):
        return None
    return doc


def owned(path: str | os.PathLike, kind: str | None = None) -> bool:
    """Did eyas make this directory (as output of `kind`, when given)?"""
    marker = read_marker(path)
    return marker is not None and (kind is None or marker["kind"] == kind)


def not_owned_error(path: str | os.PathLike, kind: str, fix: str = "choose another --out / --run-dir") -> EyasError:
    """The error for a directory eyas would otherwise write into, adopt, replace or remove."""
    marker = read_marker(path)
    if marker is not None:
        return EyasError(f"{path} holds eyas's {marker['kind']} output, not {kind} output: {fix}, or remove it "
                         f"yourself")
    return EyasError(f"{path} was not made by eyas (it has no {MARKER}) and is not empty; eyas never writes into, "
                     f"replaces or removes such a directory: {fix}, or remove it yourself")


def _holds_anything(p: Path) -> bool:
    """Anything in the directory but eyas's lock files (a lock is taken before its directory is claimed)?"""
    return any(not (e.name.startswith(".") and e.name.endswith(".lock")) for e in p.iterdir())


def check_claimable(path: str | os.PathLike, kind: str, fix: str = "choose another --out / --run-dir") -> Path:
    """Raise what `claim` would raise, writing nothing: `path` is absent, empty, or eyas's output of `kind`."""
    p = check_output_path(path)
    if p.is_dir():
        marker = read_marker(p)
        if (marker is not None and marker["kind"] != kind) or (marker is None and _holds_anything(p)):
            raise not_owned_error(p, kind, fix)
    return p


def claim(path: str | os.PathLike, kind: str, run_id: str | None = None) -> dict:
    """Make `path` an output directory of `kind` and return its marker: created with the marker when absent,
    an empty directory gets the marker, one that carries eyas's marker of this kind is taken as it is.
    Anything else raises EyasError naming the directory and the fix; nothing in it is touched."""
    p = check_claimable(path, kind)
    marker = read_marker(p)
    if marker is not None:
        return marker
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EyasError(f"cannot create {p} ({e.strerror or e}); make its parent writable or choose another "
                        f"--out / --run-dir") from None
    marker = {"made_by": "eyas", "kind": kind, "format_version": FORMAT_VERSION,
              "run_id": run_id or invocation_id(),
              "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        atomic_write_json(p / MARKER, marker)
    except OSError as e:
        raise EyasError(f"cannot write into {p} ({e.strerror or e}); make it writable or choose another --out / "
                        f"--run-dir") from None
    return marker


def lock_file(out: str | os.PathLike) -> Path:
    """The lock of an output directory: beside it, so that it outlives a directory replaced by a rename and
    never shows among the output's files."""
    p = Path(os.path.abspath(os.path.expanduser(out)))
    return p.parent / f".{p.name}{LOCK_SUFFIX}"


@contextlib.contextmanager
def exclusive(path: str | os.PathLike, what: str, fix: str = "") -> Iterator[None]:
    """An exclusive advisory lock on the file `path` for the block, released with the process even on kill -9.
    Held elsewhere: EyasError "<what> is in use by another process (pid N)[; fix]", at once. The lock file is
    removed when the block ends (while still held; a process that opened it before then finds its file gone
    from `path` once it gets the lock, and opens `path` afresh), so that no lock files pile up beside outputs."""
    import fcntl

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        f = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = f.read(32).strip()
            f.close()
            holder = holder if holder.isdigit() else "unknown"
            raise EyasError(f"{what} is in use by another process (pid {holder})" + (f"; {fix}" if fix else "")) \
                from None
        if _same_file(path, f):
            break
        f.close()  # its holder removed it as we took it: the lock is now a new file at `path`
    with f:
        mine = f"{os.getpid()}\n"
        if f.read(32) != mine:
            f.seek(0)
            f.truncate()
            f.write(mine)
            f.flush()
        try:
            yield
        finally:
            if _same_file(path, f):
                with contextlib.suppress(OSError):
                    path.unlink()


def _same_file(path: Path, f) -> bool:
    """Is the open file `f` still the file at `path`?"""
    try:
        here, held = os.stat(path), os.fstat(f.fileno())
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


@contextlib.contextmanager
def writing(out: str | os.PathLike, kind: str, *, lead: bool = True, run_id: str | None = None) -> Iterator[Path]:
    """The block writes the output directory `out` of `kind`: its path checked, its lock held and the
    directory claimed (see `claim`). Under torchrun only the lead rank (rank 0) locks and claims; the
    others write into what it claimed."""
    p = check_output_path(out)
    if not lead:
        yield p
        return
    with exclusive(lock_file(p), str(p), fix="wait for it to finish, or choose another --out"):
        existed, had_marker = p.is_dir(), read_marker(p) is not None
        claim(p, kind, run_id)
        try:
            yield p
        except BaseException:
            _unclaim_if_untouched(p, existed, had_marker)
            raise


def _unclaim_if_untouched(p: Path, existed: bool, had_marker: bool) -> None:
    """After a failed block: a directory this block claimed that holds nothing but the marker goes back to
    what it was (removed if the block created it, its marker removed if it was an empty directory)."""
    if had_marker:
        return
    try:
        if [e.name for e in p.iterdir()] != [MARKER]:
            return
        (p / MARKER).unlink()
        if not existed:
            p.rmdir()
    except OSError:
        pass
