"""Writing a whole output folder (a sharded export, a compiled export) so that good data is never lost.

    with output_folder(out, sources=[checkpoint], overwrite=args.overwrite) as tmp:
        ...write every file into tmp...
    # now `out` is the new folder, whole; on any error `out` is as it was and tmp is gone

Rules, checked before anything is written:
- `out` may not be a source folder, nor hold one (replacing it would delete what is being read);
- an `out` that holds a model or an export (config.json, weights, a manifest) is refused unless
  `overwrite=True`, and then replaced whole: no file of the old folder survives (no stale rank files);
- an `out` that holds other files is always refused: this package never deletes what it did not write;
- the new folder is built in a hidden sibling and renamed into place only when complete, so a failed
  write leaves `out` untouched (or absent), never a half-written folder that looks like something else.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from optimum_qwen35.errors import ExportError, UsageError
from optimum_qwen35.export.layout import MODEL_MARKERS, SIDE_FILES


def write_failure(out, error: OSError) -> str:
    """One line for a write the file system refused (full, read-only, no permission)."""
    code = error.errno
    if code is None and isinstance(error, shutil.Error) and error.args and isinstance(error.args[0], list):
        # copytree gathers its files' errors: (source, target, "[Errno 28] No space left on device: ...") each
        found = re.search(r"\[Errno (\d+)\]", str(error.args[0][0][-1])) if error.args[0] else None
        code = int(found.group(1)) if found else None
    cause = os.strerror(code) if code else str(error)
    what = {errno.ENOSPC: "the disk is full", errno.EROFS: "the file system is read-only",
            errno.EACCES: "permission denied", errno.EDQUOT: "the disk quota is exceeded"}.get(code, cause)
    return f"could not write {out}: {what} ({cause}); nothing was left there: free space or choose another folder"


WRITE_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT)


def is_write_failure(error: OSError) -> bool:
    """Whether the file system refused a write (full, read-only, no permission), as `write_failure` words it."""
    if isinstance(error, shutil.Error):
        return True  # copytree's gathered errors: copying into the folder failed
    return error.errno in WRITE_ERRNOS


def holds_model(folder: Path) -> bool:
    return any((folder / m).is_file() for m in MODEL_MARKERS) or any(folder.glob("*.safetensors"))


def copy_side_files(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """The source checkpoint's tokenizer, chat template and generation config, next to an export (those it has)."""
    for name in SIDE_FILES:
        if (Path(source) / name).is_file():
            shutil.copy2(Path(source) / name, Path(target) / name)


def check_output_folder(out, sources: Sequence = (), overwrite: bool = False) -> Path:
    """Where a new folder may be written; raises UsageError for a folder this write must not replace."""
    if not isinstance(out, (str, os.PathLike)) or not os.fspath(out).strip():
        raise UsageError(f"the output folder must be a path, got {out!r}")
    out = Path(out).expanduser()
    resolved = out.resolve()
    for source in sources:
        src = Path(source).expanduser().resolve()
        if resolved == src:
            raise UsageError(f"the output folder {out} is the source folder: write to another folder")
        if resolved in src.parents:
            raise UsageError(f"the output folder {out} contains the source folder {source}: write to another folder")
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out} is a file, not a folder: choose a new folder for the output")
    if out.is_dir() and any(out.iterdir()):
        if not holds_model(out):
            raise UsageError(
                f"{out} is not empty and does not hold a model or an export: choose a new or empty folder "
                "(this package does not delete files it did not write)"
            )
        if not overwrite:
            raise UsageError(
                f"{out} already holds a model or an export: choose a new folder, or pass --overwrite "
                "(overwrite=True) to replace it whole"
            )
    return out


@contextmanager
def output_folder(out, sources: Sequence = (), overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling folder to fill; on success it replaces `out` whole, on error it is removed."""
    out = check_output_folder(out, sources, overwrite)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as error:
        raise ExportError(write_failure(out, error)) from error
    try:
        yield tmp
    except OSError as error:  # nothing half-written is left; a full or read-only disk, no permission: one line
        shutil.rmtree(tmp, ignore_errors=True)
        if not is_write_failure(error):
            raise  # another failure (a source that cannot be read, say) says what it is itself
        raise ExportError(write_failure(out, error)) from error
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    try:
        if out.exists():
            os.rename(out, old)
        os.rename(tmp, out)
    except OSError as e:
        if old.exists() and not out.exists():
            os.rename(old, out)  # put the previous folder back
        shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(f"could not move the new folder into place at {out}: {e}") from e
    shutil.rmtree(old, ignore_errors=True)
