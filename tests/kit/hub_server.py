"""A loopback stand-in for the Hugging Face Hub HTTP API, for tests.

The Hub cannot be reached from the test machines, so the tests point the real `huggingface_hub` client
(0.36 in the optimum-neuron environment, 2.x in the reference one) and optimum-neuron's cache code at this
server through `HF_ENDPOINT` (or an explicit `endpoint=`). It implements the part of the Hub API those
clients call, with the Hub's semantics:

- repositories: `POST /api/repos/create` (409 if it exists; a new repo gets an initial commit with
  `.gitattributes`, as on the Hub), `GET /api/models/{repo}[/revision/{rev}]` (sha, siblings),
  `GET /api/models/{repo}/refs`, `POST /api/models/{repo}/branch/{branch}` (409 if it exists);
- uploads: `POST /api/models/{repo}/preupload/{rev}` (upload mode "lfs" for large or binary files,
  "regular" otherwise, and the remote oid so the client can skip unchanged files),
  `POST /{repo}.git/info/lfs/objects/batch` (the LFS batch API, "basic" transfer only: no Xet, so
  huggingface_hub 2.x must run with `HF_HUB_DISABLE_XET=1`), the one-shot upload URL it hands out, and
  `POST /api/models/{repo}/commit/{rev}` (NDJSON header/file/lfsFile/deletedFile/deletedFolder lines;
  atomic: a rejected commit changes nothing); `POST /api/validate-yaml`;
- reads: `GET /api/models/{repo}/tree/{rev}[/{path}]` (recursive or not, with oid, size and lfs info),
  `GET|HEAD /{repo}/resolve/{rev}/{path}` (`X-Repo-Commit`, `ETag`, `X-Linked-Etag`/`X-Linked-Size` for
  LFS files, byte ranges), `GET /api/whoami-v2`;
- errors as the Hub sends them: 404 with `X-Error-Code: RepoNotFound` / `RevisionNotFound` /
  `EntryNotFound`, 401 for an unknown token ("Invalid credentials in Authorization header") or a missing
  one, 403 for a token without write access to the namespace.

Tokens: `HubServer(tokens={"hf_write": ("alice", True), "hf_read": ("alice", False)})`: a token maps to a
user name and whether it may write. A user reads and writes repos under its own name; public repos are
readable by anyone. Every request is logged (`server.requests`) and `server.fail_commits = True` makes the
commit endpoint answer 500, so tests can check what a failed upload leaves behind; `server.drop_uploads = True`
closes the connection of every LFS upload without an answer (a connection that drops mid-push);
`server.cut_downloads = n` cuts the next n file downloads mid-file (half the announced bytes, then the connection
closes);
`server.commit_url_base` sets the host of the commit URL a commit answers with (the Hub's public URL, whatever
endpoint the client used).

Use:

    with HubServer(tokens=...) as hub:        # or the `hub_server` pytest fixture in tests/conftest.py
        HfApi(endpoint=hub.url, token="hf_write").create_repo("alice/model")
        hub.commits("alice/model")            # the commit shas of a branch, newest first

Only the standard library is used. This module is test infrastructure: the package never imports it.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["HubServer", "free_port", "git_blob_oid"]

# Files the Hub stores through LFS: the patterns of the `.gitattributes` a new repo gets (a subset of the
# Hub's default list), plus anything above 10 MB.
LFS_PATTERNS = (
    "*.7z", "*.arrow", "*.bin", "*.bz2", "*.ckpt", "*.gz", "*.h5", "*.joblib", "*.model", "*.msgpack",
    "*.neff", "*.npy", "*.npz", "*.onnx", "*.ot", "*.parquet", "*.pb", "*.pickle", "*.pkl", "*.pt", "*.pt2",
    "*.pth", "*.safetensors", "*.tar", "*.tflite", "*.tgz", "*.xz", "*.zip", "*.zst",
)  # fmt: skip
LFS_SIZE_THRESHOLD = 10 * 1024 * 1024
GITATTRIBUTES = "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in LFS_PATTERNS).encode()


def git_blob_oid(data: bytes) -> str:
    """The git object id of a blob (what the Hub reports as a regular file's oid and ETag)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (right now)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class _File:
    size: int
    oid: str  # git blob oid (of the pointer file for LFS files)
    data: bytes | None = None  # regular files
    lfs_sha256: str | None = None  # LFS files: their content lives in the server's LFS store

    def tree_entry(self, path: str) -> dict:
        entry = {"type": "file", "oid": self.oid, "size": self.size, "path": path}
        if self.lfs_sha256 is not None:
            pointer = _lfs_pointer(self.lfs_sha256, self.size)
            entry["lfs"] = {"oid": self.lfs_sha256, "size": self.size, "pointerSize": len(pointer)}
        return entry


@dataclass
class _Commit:
    sha: str
    parent: str | None
    message: str
    files: dict[str, _File]
    date: float


@dataclass
class _Repo:
    repo_id: str
    private: bool
    commits: dict[str, _Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)

    def resolve(self, revision: str) -> _Commit | None:
        if revision in self.branches:
            return self.commits[self.branches[revision]]
        return self.commits.get(revision)


class _HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, **body):
        super().__init__(message)
        self.status, self.message, self.code, self.body = status, message, code, body


def _not_found(what: str, code: str) -> _HubError:
    return _HubError(404, what, code)


class HubServer:
    """The stand-in Hub: start() / stop(), or use it as a context manager. `url` is the endpoint."""

    def __init__(self, tokens: dict[str, tuple[str, bool]] | None = None, host: str = "127.0.0.1"):
        self.tokens = dict(tokens or {})
        self.repos: dict[str, _Repo] = {}
        self.lfs_store: dict[str, bytes] = {}
        self.requests: list[tuple[str, str, int]] = []  # (method, path, status)
        self.fail_commits = False
        self.cut_downloads = 0  # file downloads (GET resolve) still to cut mid-file
        self.drop_uploads = False
        self.commit_url_base: str | None = None
        self._pending_uploads: dict[str, tuple[str, int]] = {}  # upload key -> (sha256, size)
        self._lock = threading.RLock()
        self._counter = 0
        self._host = host
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        assert self._httpd is not None, "server not started"
        return f"http://{self._host}:{self._httpd.server_address[1]}"

    def start(self) -> HubServer:
        server = self

        class Handler(_Handler):
            hub = server

        self._httpd = ThreadingHTTPServer((self._host, 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hub-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join(timeout=5)
            self._httpd = None

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---------------------------------------------------------------------------------- test inspection

    def commits(self, repo_id: str, branch: str = "main") -> list[str]:
        """Commit shas reachable from `branch`, newest first."""
        with self._lock:
            repo = self.repos[repo_id]
            out, sha = [], repo.branches.get(branch)
            while sha is not None:
                out.append(sha)
                sha = repo.commits[sha].parent
            return out

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """The files of a revision, path -> content."""
        with self._lock:
            commit = self.repos[repo_id].resolve(revision)
            return {p: self._content(f) for p, f in commit.files.items()}

    def client_env(self, hf_home, token: str | None = None, **extra: str) -> dict[str, str]:
        """Environment for a client subprocess: this endpoint, its own (empty) HF_HOME, LFS instead of Xet."""
        import os

        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
        env.update(HF_ENDPOINT=self.url, HF_HOME=str(hf_home), HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1")
        env.pop("CUSTOM_CACHE_REPO", None)
        if token is not None:
            env["HF_TOKEN"] = token
        env.update(extra)
        return env

    def count(self, method: str, path_part: str) -> int:
        """How many logged requests used `method` on a path containing `path_part`."""
        return sum(1 for m, p, _ in self.requests if m == method and path_part in p)

    def create_repo(self, repo_id: str, private: bool = False) -> None:
        """Create a repo directly (test setup), as `POST /api/repos/create` does."""
        with self._lock:
            self._new_repo(repo_id, private)

    def upload(self, repo_id: str, files: dict[str, bytes], message: str = "upload", branch: str = "main") -> str:
        """Commit files directly (test setup); returns the commit sha."""
        with self._lock:
            repo = self.repos[repo_id]
            head = repo.commits[repo.branches[branch]]
            new = dict(head.files)
            for path, data in files.items():
                new[path] = self._store(path, data)
            return self._commit(repo, branch, head.sha, message, new)

    # ------------------------------------------------------------------------------------------- storage

    def _content(self, f: _File) -> bytes:
        return f.data if f.lfs_sha256 is None else self.lfs_store[f.lfs_sha256]

    @staticmethod
    def _is_lfs(path: str, size: int) -> bool:
        name = path.rsplit("/", 1)[-1]
        return size > LFS_SIZE_THRESHOLD or any(fnmatch.fnmatch(name, p) for p in LFS_PATTERNS)

    def _store(self, path: str, data: bytes) -> _File:
        if self._is_lfs(path, len(data)) and len(data) > 0:
            sha = hashlib.sha256(data).hexdigest()
            self.lfs_store[sha] = data
            return _File(len(data), git_blob_oid(_lfs_pointer(sha, len(data))), lfs_sha256=sha)
        return _File(len(data), git_blob_oid(data), data=data)

    def _new_sha(self, *parts: str) -> str:
        self._counter += 1
        return hashlib.sha1("\0".join((*parts, str(self._counter), str(time.time()))).encode()).hexdigest()

    def _commit(self, repo: _Repo, branch: str, parent: str | None, message: str, files: dict[str, _File]) -> str:
        sha = self._new_sha(repo.repo_id, branch, message)
        repo.commits[sha] = _Commit(sha, parent, message, files, time.time())
        repo.branches[branch] = sha
        return sha

    def _new_repo(self, repo_id: str, private: bool) -> _Repo:
        repo = _Repo(repo_id, private)
        self.repos[repo_id] = repo
        self._commit(
            repo, "main", None, "initial commit", {".gitattributes": self._store(".gitattributes", GITATTRIBUTES)}
        )
        return repo


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"
    server_version = "StandInHub/1.0"

    def log_message(self, format, *args):  # quiet
        pass

    # ------------------------------------------------------------------------------------------- plumbing

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False) -> None:
        self.send_response(status)
        headers = dict(headers or {})
        headers.setdefault("Content-Length", str(len(body)))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if body and not head:
            self.wfile.write(body)
        self.hub.requests.append((self.command, urlsplit(self.path).path, status))

    def _json(self, status: int, obj, headers: dict | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})})

    def _error(self, e: _HubError, head: bool = False) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Message": e.message}
        if e.code:
            headers["X-Error-Code"] = e.code
        self._send(e.status, b"" if head else json.dumps({"error": e.message, **e.body}).encode(), headers, head=head)

    def _user(self) -> tuple[str | None, bool]:
        """(user, can_write) of the request's token; (None, False) without one; 401 for an unknown one."""
        auth = self.headers.get("Authorization", "")
        if not auth.lower().startswith("bearer "):
            return None, False
        token = auth[7:].strip()
        if token not in self.hub.tokens:
            raise _HubError(401, "Invalid credentials in Authorization header")
        return self.hub.tokens[token]

    def _repo(self, repo_id: str, write: bool = False) -> _Repo:
        user, can_write = self._user()
        repo = self.hub.repos.get(repo_id)
        owner = repo_id.split("/")[0]
        if repo is None or (repo.private and user != owner):
            if user is None:
                raise _HubError(401, "Repository not found", "RepoNotFound")
            raise _not_found("Repository not found", "RepoNotFound")
        if write:
            self._check_write(user, can_write, owner)
        return repo

    @staticmethod
    def _check_write(user: str | None, can_write: bool, owner: str) -> None:
        if user is None:
            raise _HubError(401, "You must be authenticated to do this")
        if user != owner or not can_write:
            raise _HubError(403, f"You don't have the rights to write to the namespace {owner}")

    @staticmethod
    def _revision(repo: _Repo, revision: str) -> _Commit:
        commit = repo.resolve(revision)
        if commit is None:
            raise _not_found(f"Invalid rev id: {revision}", "RevisionNotFound")
        return commit

    # ------------------------------------------------------------------------------------------- routing

    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        segs = [unquote(s) for s in url.path.strip("/").split("/")] if url.path.strip("/") else []
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        body = self._body() if method in ("POST", "PUT") else b""
        if self.hub.drop_uploads and method == "PUT" and segs[:1] == ["__lfs_upload__"]:
            self.close_connection = True  # no answer: the client sees the connection drop
            self.hub.requests.append((method, url.path, 0))  # status 0: dropped
            return
        try:
            with self.hub._lock:
                self._route(method, segs, query, body)
        except _HubError as e:
            self._error(e, head=method == "HEAD")
        except Exception as e:  # a bug in the stand-in: make it visible
            self._error(_HubError(500, f"stand-in hub error: {type(e).__name__}: {e}"), head=method == "HEAD")

    def _route(self, method: str, segs: list[str], query: dict, body: bytes) -> None:
        if segs[:2] == ["api", "repos"] and segs[2:] == ["create"] and method == "POST":
            return self._create_repo(json.loads(body or b"{}"))
        if segs[:2] == ["api", "whoami-v2"] and method == "GET":
            return self._whoami()
        if segs[:2] == ["api", "validate-yaml"] and method == "POST":
            return self._json(200, {"errors": [], "warnings": []})
        if len(segs) >= 4 and segs[:2] == ["api", "models"]:
            repo_id, rest = "/".join(segs[2:4]), segs[4:]
            if not rest and method == "GET":
                return self._model_info(repo_id, "main", query)
            action = rest[0]
            if action == "revision" and len(rest) == 2 and method == "GET":
                return self._model_info(repo_id, rest[1], query)
            if action == "refs" and method == "GET":
                return self._refs(repo_id)
            if action == "tree" and len(rest) >= 2 and method == "GET":
                return self._tree(repo_id, rest[1], "/".join(rest[2:]), query)
            if action == "branch" and len(rest) == 2 and method == "POST":
                return self._create_branch(repo_id, rest[1], json.loads(body or b"{}"))
            if action == "preupload" and len(rest) == 2 and method == "POST":
                return self._preupload(repo_id, rest[1], json.loads(body))
            if action == "commit" and len(rest) == 2 and method == "POST":
                return self._commit(repo_id, rest[1], body)
        if segs[:1] == ["__lfs_upload__"] and len(segs) == 2 and method == "PUT":
            return self._lfs_put(segs[1], body)
        if len(segs) == 6 and segs[1].endswith(".git") and segs[2:] == ["info", "lfs", "objects", "batch"]:
            return self._lfs_batch(f"{segs[0]}/{segs[1][:-4]}", json.loads(body))
        if len(segs) >= 5 and segs[2] == "resolve" and method in ("GET", "HEAD"):
            return self._resolve("/".join(segs[:2]), segs[3], "/".join(segs[4:]), head=method == "HEAD")
        raise _HubError(404, f"no such endpoint in the stand-in hub: {method} {self.path}")

    # ------------------------------------------------------------------------------------------ handlers

    def _whoami(self) -> None:
        user, can_write = self._user()
        if user is None:
            raise _HubError(401, "Invalid credentials in Authorization header")
        role = "write" if can_write else "read"
        self._json(200, {"type": "user", "name": user, "orgs": [], "auth": {"accessToken": {"role": role}}})

    def _create_repo(self, payload: dict) -> None:
        user, can_write = self._user()
        name, org = payload.get("name"), payload.get("organization")
        namespace = org or user
        if namespace is None:
            raise _HubError(401, "You must be authenticated to do this")
        self._check_write(user, can_write, namespace)
        if payload.get("type", "model") not in ("model", None):
            raise _HubError(400, "the stand-in hub only hosts model repos")
        repo_id = f"{namespace}/{name}"
        if repo_id in self.hub.repos:
            raise _HubError(409, "You already created this model repo", url=f"{self.hub.url}/{repo_id}")
        private = bool(payload.get("private")) or payload.get("visibility") == "private"
        self.hub._new_repo(repo_id, private)
        self._json(200, {"url": f"{self.hub.url}/{repo_id}", "name": repo_id, "id": repo_id})

    def _model_info(self, repo_id: str, revision: str, query: dict) -> None:
        repo = self._repo(repo_id)
        commit = self._revision(repo, revision)
        blobs = query.get("blobs", "").lower() == "true"
        siblings = []
        for path, f in sorted(commit.files.items()):
            sibling = {"rfilename": path}
            if blobs:
                sibling.update(size=f.size, blobId=f.oid)
                if f.lfs_sha256:
                    pointer = _lfs_pointer(f.lfs_sha256, f.size)
                    sibling["lfs"] = {"sha256": f.lfs_sha256, "size": f.size, "pointerSize": len(pointer)}
            siblings.append(sibling)
        date = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(commit.date))
        self._json(
            200,
            {
                "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
                "id": repo_id,
                "modelId": repo_id,
                "author": repo_id.split("/")[0],
                "sha": commit.sha,
                "lastModified": date,
                "createdAt": date,
                "private": repo.private,
                "disabled": False,
                "gated": False,
                "downloads": 0,
                "likes": 0,
                "tags": [],
                "siblings": siblings,
            },
        )

    def _refs(self, repo_id: str) -> None:
        repo = self._repo(repo_id)
        branches = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": s} for b, s in sorted(repo.branches.items())]
        self._json(200, {"branches": branches, "converts": [], "tags": []})

    def _tree(self, repo_id: str, revision: str, path: str, query: dict) -> None:
        repo = self._repo(repo_id)
        commit = self._revision(repo, revision)
        recursive = query.get("recursive", "").lower() == "true"
        prefix = path.strip("/") + "/" if path.strip("/") else ""
        if prefix and not any(p.startswith(prefix) for p in commit.files):
            if prefix[:-1] in commit.files:
                raise _HubError(400, f"{path} is a file, not a directory")
            raise _not_found(f"{path} does not exist on {revision}", "EntryNotFound")
        entries, dirs = [], set()
        for p, f in sorted(commit.files.items()):
            if not p.startswith(prefix):
                continue
            parts = p[len(prefix) :].split("/")
            for i in range(1, len(parts)):
                d = prefix + "/".join(parts[:i])
                if (recursive or i == 1) and d not in dirs:
                    dirs.add(d)
                    entries.append({"type": "directory", "oid": git_blob_oid(d.encode()), "size": 0, "path": d})
            if recursive or len(parts) == 1:
                entries.append(f.tree_entry(p))
        self._json(200, entries)

    def _create_branch(self, repo_id: str, branch: str, payload: dict) -> None:
        repo = self._repo(repo_id, write=True)
        if branch in repo.branches:
            raise _HubError(409, f"Reference refs/heads/{branch} already exists")
        start = self._revision(repo, payload.get("startingPoint") or "main")
        repo.branches[branch] = start.sha
        self._json(200, {})

    def _preupload(self, repo_id: str, revision: str, payload: dict) -> None:
        repo = self._repo(repo_id, write=True)
        commit = self._revision(repo, revision)
        out = []
        for item in payload["files"]:
            path, size = item["path"], int(item["size"])
            lfs = self.hub._is_lfs(path, size) and size > 0
            info = {"path": path, "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False}
            remote = commit.files.get(path)
            if remote is not None:
                info["oid"] = remote.lfs_sha256 if remote.lfs_sha256 else remote.oid
            out.append(info)
        self._json(200, {"files": out, "commitOid": commit.sha})

    def _lfs_batch(self, repo_id: str, payload: dict) -> None:
        self._repo(repo_id, write=payload.get("operation") == "upload")
        if payload.get("operation") != "upload":
            raise _HubError(400, "the stand-in hub only implements LFS uploads through the batch API")
        objects = []
        for obj in payload["objects"]:
            oid, size = obj["oid"], int(obj["size"])
            entry = {"oid": oid, "size": size, "authenticated": True}
            if oid not in self.hub.lfs_store:  # no "actions": the object is already stored, nothing to send
                key = secrets.token_hex(16)
                self.hub._pending_uploads[key] = (oid, size)
                entry["actions"] = {"upload": {"href": f"{self.hub.url}/__lfs_upload__/{key}", "header": {}}}
            objects.append(entry)
        self._json(200, {"transfer": "basic", "objects": objects, "hash_algo": "sha256"})

    def _lfs_put(self, key: str, body: bytes) -> None:
        if key not in self.hub._pending_uploads:
            raise _HubError(403, "unknown or used upload URL")
        oid, size = self.hub._pending_uploads.pop(key)
        if len(body) != size or hashlib.sha256(body).hexdigest() != oid:
            raise _HubError(400, "uploaded content does not match its oid/size")
        self.hub.lfs_store[oid] = body
        self._send(200)

    def _commit(self, repo_id: str, revision: str, body: bytes) -> None:
        repo = self._repo(repo_id, write=True)
        if revision not in repo.branches:
            raise _not_found(f"Invalid rev id: {revision}", "RevisionNotFound")
        head = repo.commits[repo.branches[revision]]
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        header = next((line["value"] for line in lines if line["key"] == "header"), None)
        if header is None or not header.get("summary"):
            raise _HubError(400, "commit header with a summary is required")
        if header.get("parentCommit") and header["parentCommit"] != head.sha:
            raise _HubError(412, "A commit has happened since. Please refresh and try again.")
        files = dict(head.files)  # built aside: nothing changes unless the whole commit is valid
        for line in lines:
            key, value = line["key"], line["value"]
            if key == "file":
                data = (
                    base64.b64decode(value["content"])
                    if value.get("encoding") == "base64"
                    else value["content"].encode()
                )
                files[value["path"]] = _File(len(data), git_blob_oid(data), data=data)
            elif key == "lfsFile":
                oid = value["oid"]
                if oid not in self.hub.lfs_store:
                    raise _HubError(422, f"LFS object {oid} of {value['path']} was never uploaded")
                size = len(self.hub.lfs_store[oid])
                files[value["path"]] = _File(size, git_blob_oid(_lfs_pointer(oid, size)), lfs_sha256=oid)
            elif key == "deletedFile":
                if value["path"] not in files:
                    raise _not_found(f"A file with this name doesn't exist: {value['path']}", "EntryNotFound")
                del files[value["path"]]
            elif key == "deletedFolder":
                prefix = value["path"].rstrip("/") + "/"
                for p in [p for p in files if p.startswith(prefix)]:
                    del files[p]
            elif key != "header":
                raise _HubError(400, f"the stand-in hub does not implement commit operation {key!r}")
        if self.hub.fail_commits:
            raise _HubError(500, "Internal Error - We're working hard to fix this as soon as possible!")
        message = header["summary"] + ("\n\n" + header["description"] if header.get("description") else "")
        sha = self.hub._commit(repo, revision, head.sha, message, files)
        url = f"{self.hub.commit_url_base or self.hub.url}/{repo_id}/commit/{sha}"
        self._json(200, {"success": True, "commitOid": sha, "commitUrl": url, "hookOutput": "", "pullRequestUrl": None})

    def _resolve(self, repo_id: str, revision: str, path: str, head: bool) -> None:
        repo = self._repo(repo_id)
        commit = self._revision(repo, revision)
        f = commit.files.get(path)
        if f is None:
            raise _not_found(f"Entry not found: {path}", "EntryNotFound")
        data = self.hub._content(f)
        headers = {
            "Content-Type": "application/octet-stream",
            "X-Repo-Commit": commit.sha,
            "ETag": f'"{f.oid}"',
            "Accept-Ranges": "bytes",
        }
        if f.lfs_sha256:
            headers.update({"X-Linked-Etag": f'"{f.lfs_sha256}"', "X-Linked-Size": str(f.size)})
        status, rng = 200, self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            start_s, _, end_s = rng[6:].partition("-")
            start = int(start_s or 0)
            end = int(end_s) if end_s else len(data) - 1
            if start >= len(data) and len(data) > 0:
                return self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"}, head=head)
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            data, status = data[start : end + 1], 206
        if not head and len(data) > 1 and self.hub.cut_downloads > 0:
            self.hub.cut_downloads -= 1
            return self._send_cut(status, data, headers)
        self._send(status, data, headers, head=head)

    def _send_cut(self, status: int, body: bytes, headers: dict) -> None:
        """A download cut mid-file: the whole length announced, half the bytes sent, the connection closed."""
        self.send_response(status)
        headers = {**headers, "Content-Length": str(len(body))}
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body[: len(body) // 2])
        self.wfile.flush()
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)
        self.hub.requests.append((self.command, urlsplit(self.path).path, "cut"))
