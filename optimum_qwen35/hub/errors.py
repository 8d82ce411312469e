"""huggingface_hub's exceptions as this package's one-line errors (`HubError` and its subclasses, errors.py)."""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from pathlib import Path

from huggingface_hub import constants, get_token
from huggingface_hub import errors as hf_errors
from huggingface_hub.utils import HFValidationError, validate_repo_id

from optimum_qwen35.errors import (
    CheckpointError,
    HubAuthError,
    HubConnectionError,
    HubError,
    HubNotFoundError,
    HubOfflineError,
    IncompatibleExportError,
    UsageError,
)
from optimum_qwen35.patches import hub_retries


def _endpoint_name(endpoint: str | None) -> str:
    if endpoint:
        return endpoint
    return constants.ENDPOINT


def is_offline() -> bool:
    flag = getattr(constants, "is_offline_mode", None)
    if callable(flag):
        return bool(flag())
    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def _chain(error: BaseException):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _is_connection_error(error: BaseException) -> bool:
    for e in _chain(error):
        name = type(e).__name__
        # httpx (huggingface_hub 1.x+): a connection that drops mid-request is a RemoteProtocolError / ReadError.
        # requests (huggingface_hub 0.x, the NxD stack): a body cut mid-file is a ChunkedEncodingError.
        dropped = ("RemoteProtocolError", "ReadError", "WriteError", "RemoteDisconnected", "ChunkedEncodingError",
                   "IncompleteRead", "ProtocolError")
        if isinstance(e, (ConnectionError, TimeoutError)) or name in ("ConnectError", "ConnectTimeout", "ReadTimeout", *dropped):
            return True
        if "ConnectionError" in name or ("Timeout" in name and "Lock" not in name):
            return True
    return False


def _server_message(error: BaseException) -> str:
    msg = getattr(error, "server_message", None) or ""
    if not msg:
        response = getattr(error, "response", None)
        if response is not None:
            msg = response.headers.get("X-Error-Message", "") or ""
    return " ".join(str(msg).split())[:200]


def http_status(error: BaseException) -> int | None:
    response = getattr(error, "response", None)
    return getattr(response, "status_code", None)


@contextmanager
def hub_errors(action: str, repo_id: str, endpoint: str | None, revision: str | None = None, token=None):
    """Turn huggingface_hub's exceptions into one-line package errors saying what to do."""
    where = f"{repo_id}" + (f" (revision {revision!r})" if revision and revision != "main" else "")
    try:
        with hub_retries():
            yield
    except (HubError, IncompatibleExportError, CheckpointError, UsageError):
        raise
    except hf_errors.OfflineModeIsEnabled as e:
        raise HubOfflineError(f"cannot {action} {where}: offline mode (HF_HUB_OFFLINE=1) is on") from e
    except hf_errors.RevisionNotFoundError as e:
        raise HubNotFoundError(f"cannot {action} {where}: revision {revision!r} does not exist in {repo_id}") from e
    except hf_errors.RepositoryNotFoundError as e:
        who = "without a token" if token is False or (token is None and not _has_token()) else "with this token"
        raise HubNotFoundError(
            f"cannot {action} {where}: repository {repo_id} not found on {_endpoint_name(endpoint)}"
            f" (or it is private and not readable {who})"
        ) from e
    except hf_errors.GatedRepoError as e:
        raise HubAuthError(f"cannot {action} {where}: the repository is gated; request access on the Hub") from e
    except getattr(hf_errors, "IncompleteSnapshotError", ()) as e:  # huggingface_hub 2.x: a partial cached snapshot
        found = re.search(r"(\d+ file\(s\) are missing \(.*?\))\.", " ".join(str(e).split()))
        what = found.group(1) if found else "files are missing"
        raise HubOfflineError(
            f"cannot {action} {where}: the Hub is not used (offline mode) or not reachable, and its cached snapshot"
            f" is incomplete, {what}; download it once online"
        ) from e
    except getattr(hf_errors, "LocalEntryNotFoundError", ()) as e:  # before EntryNotFoundError (its subclass in 0.x)
        if is_offline():
            raise HubOfflineError(
                f"cannot {action} {where}: offline mode (HF_HUB_OFFLINE=1) and it is not in the local cache"
            ) from e
        if _is_connection_error(e) or "internet connection" in str(e):
            raise HubConnectionError(
                f"cannot {action} {where}: the Hub at {_endpoint_name(endpoint)} cannot be reached"
            ) from e
        raise HubNotFoundError(f"cannot {action} {where}: {' '.join(str(e).split())[:200]}") from e
    except hf_errors.EntryNotFoundError as e:
        raise HubNotFoundError(
            f"cannot {action} {where}: a file is missing from the repository ({_short_url(e)})"
        ) from e
    except hf_errors.HfHubHTTPError as e:
        status, message = http_status(e), _server_message(e)
        if status == 401:
            if token is False or (token is None and not _has_token()):
                raise HubAuthError(
                    f"cannot {action} {where}: the Hub needs a token for this (401 {message or 'unauthorized'});"
                    " pass --token or set HF_TOKEN"
                ) from e
            raise HubAuthError(
                f"cannot {action} {where}: the Hub rejected the token (401 {message or 'unauthorized'});"
                " pass a valid --token or set HF_TOKEN"
            ) from e
        if status == 403:
            raise HubAuthError(
                f"cannot {action} {where}: the token has no write access (403 {message or 'forbidden'});"
                " use a token with write rights on the namespace"
            ) from e
        if status == 412:
            raise HubError(f"cannot {action} {where}: the branch changed during the push; push again") from e
        raise HubError(f"cannot {action} {where}: HTTP {status} {message}".rstrip()) from e
    except Exception as e:
        answered = _status_in_message(e)
        if answered:
            # hf_xet (huggingface_hub's Xet uploads and downloads) reports an HTTP error status as a ConnectionError.
            status, reason, url = answered
            hint = " (a server without Xet storage: set HF_HUB_DISABLE_XET=1)" if "xet" in url.lower() else ""
            said = f"cannot {action} {where}: the Hub at {_endpoint_name(endpoint)} answered {status} {reason} for {url}"
            if status == 404:
                raise HubNotFoundError(said + hint) from e
            raise (HubAuthError if status in (401, 403) else HubError)(said) from e
        if _is_connection_error(e):
            raise HubConnectionError(
                f"cannot {action} {where}: the Hub at {_endpoint_name(endpoint)} cannot be reached ({type(e).__name__})"
            ) from e
        raise


_STATUS_IN_MESSAGE = re.compile(r"HTTP status (?:client|server) error \((\d{3}) ([^)]*)\)(?:, domain: (\S+))?")


def _status_in_message(error: BaseException) -> tuple[int, str, str] | None:
    """(status, reason, url) when an error of the chain is a server's HTTP answer reported in words (hf_xet's
    "HTTP status client error (404 Not Found), domain: <url>"), else None."""
    for e in _chain(error):
        found = _STATUS_IN_MESSAGE.search(str(e))
        if found:
            return int(found.group(1)), found.group(2), found.group(3) or "a request"
    return None


def _short_url(error: BaseException) -> str:
    response = getattr(error, "response", None)
    url = str(getattr(response, "url", "") or "")
    return url.split("/resolve/", 1)[-1] if url else "unknown file"


def _has_token() -> bool:
    return get_token() is not None


def repo_id_problem(repo_id) -> str | None:
    """Why `repo_id` breaks the Hub's naming rules (huggingface_hub's own validator), or None."""
    if not isinstance(repo_id, str) or not repo_id:
        return "it is empty"
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        return " ".join(str(e).split())
    return None


def check_repo_id(repo_id: str) -> None:
    problem = repo_id_problem(repo_id)
    if problem:
        raise UsageError(f"{repo_id!r} is not a valid Hub repository id: {problem} (expected 'namespace/name')")


def at_revision(revision: str | None) -> str:
    return f"@{revision}" if revision else ""


def no_folder_either(name: str, error: HubError) -> HubError:
    """A name that is no local folder and failed on the Hub may be a mistyped path (`tinyy`): say both."""
    if "no local folder" in str(error) or Path(name).exists():
        return error
    return type(error)(f"{error}; there is no local folder {name!r} either")

