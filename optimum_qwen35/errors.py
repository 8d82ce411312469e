"""The exceptions this package raises for anything a user can fix.

Every error a user can cause (bad input, a wrong path, a folder exported for something else) is a
`Qwen35Error`. Its message says what was wrong and what to do. The command line prints that message on
one line (a traceback only under `--debug`), with exit status 2 for usage errors and 1 otherwise.

They also derive from the built-in type a caller would expect (ValueError, FileNotFoundError), so code
written against those keeps working.
"""

from __future__ import annotations


class Qwen35Error(Exception):
    """Base class: a failure the user can fix; the message says how."""

    exit_status = 1


class UsageError(Qwen35Error, ValueError):
    """An argument is invalid (a wrong type, a value out of range, options that do not go together)."""

    exit_status = 2


class ModelNotFoundError(Qwen35Error, FileNotFoundError):
    """A path or Hub id names nothing this package can load."""


class UnsupportedModelError(Qwen35Error, ValueError):
    """The configuration describes a model this package does not implement."""


class CheckpointError(Qwen35Error, ValueError):
    """A checkpoint or an export does not hold the tensors its config needs, or holds bad ones."""


class MissingWeightsError(CheckpointError, FileNotFoundError):
    """A checkpoint folder lacks weight files (none at all, or files its index names)."""


class IncompatibleExportError(Qwen35Error, ValueError):
    """An exported folder was compiled for something else (target, TP degree, shapes, versions)."""


class ExportError(Qwen35Error, RuntimeError):
    """An export could not be written."""


class WorkerLostError(Qwen35Error, RuntimeError):
    """A tensor-parallel worker process died, or a call to the workers was interrupted: that call's work and the
    workers' state are lost; the next call starts the workers again (runtime/worker_pool.py)."""


class MissingDependencyError(Qwen35Error, ImportError):
    """An optional dependency this operation needs is not installed (the message names the extra to install)."""


class HubError(Qwen35Error, OSError):
    """A Hugging Face Hub operation failed (push, download, cache registry)."""


class HubNotFoundError(HubError, FileNotFoundError):
    """A Hub repository, revision or file does not exist (or is private and the token cannot see it)."""


class HubAuthError(HubError, PermissionError):
    """The Hub rejected the token: unknown or missing (401), or without the rights the operation needs (403)."""


class HubConnectionError(HubError, ConnectionError):
    """The Hub endpoint cannot be reached."""


class HubOfflineError(HubError, FileNotFoundError):
    """Offline mode (HF_HUB_OFFLINE=1) and the local Hugging Face cache lacks the files (the message names them)."""
