"""A minimal Hugging Face Hub on 127.0.0.1 that answers the requests huggingface_hub 2.4.0 makes.

Used by the contract tests: repo creation, branches, README YAML validation, preupload, the LFS batch API
with single-part PUT uploads, ndjson commits, tree listings, model info, and resolve HEAD/GET downloads.
Every request is logged so tests can assert what was sent. Nothing here contacts any other address.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlparse

import yaml

TOKEN = "hf_contract_test_token"


@dataclass
class Repo:
    files: dict[str, bytes] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    private: bool = False

    def resolve(self, revision: str) -> str | None:
        revision = unquote(revision)
        if revision in self.branches:
            return self.branches[revision]
        return revision if revision in self.commits else None


class FakeHub:
    """State shared by the handler threads."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}
        self.log: list[tuple[str, str]] = []
        self.commit_payloads: list[list[dict[str, Any]]] = []
        self.validated_yaml: list[str] = []
        self.lfs_puts: list[tuple[str, int]] = []
        self.reject_tokens = False
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> FakeHub:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def seed(self, repo_id: str, files: dict[str, bytes]) -> str:
        """Create `repo_id` with one commit holding `files`; return the commit sha."""
        repo = self.repos.setdefault(repo_id, Repo())
        sha = uuid.uuid4().hex + uuid.uuid4().hex[:8]
        repo.commits[sha] = dict(files)
        repo.branches["main"] = sha
        return sha

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        repo = self.repos[repo_id]
        return repo.commits[repo.resolve(revision)]


_MODEL_API = re.compile(
    r"^/api/models/(?P<repo>[^/]+(?:/[^/]+)?)/(?P<op>preupload|commit|branch|tree|revision)/(?P<rest>.+)$"
)
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
_LFS_BATCH = re.compile(r"^/(?P<repo>[^/]+/[^/]+)\.git/info/lfs/objects/batch$")


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # keep test output quiet
            pass

        # -- plumbing ------------------------------------------------------------------------------------
        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                    if size == 0:
                        self.rfile.readline()
                        return b"".join(chunks)
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _send(
            self, status: int, body: Any = b"", headers: dict[str, str] | None = None, head: bool = False
        ) -> None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            content_type = "application/octet-stream" if isinstance(body, bytes) else "application/json"
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            if not head:
                self.wfile.write(data)

        def _error(self, status: int, code: str, message: str, head: bool = False) -> None:
            self._send(status, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message}, head=head)

        def _authorized(self) -> bool:
            if hub.reject_tokens or self.headers.get("authorization") != f"Bearer {TOKEN}":
                self._send(
                    401,
                    {"error": "Invalid credentials in Authorization header"},
                    {"X-Error-Message": "Invalid credentials in Authorization header"},
                )
                return False
            return True

        def _dispatch(self, method: str) -> None:
            path = urlparse(self.path).path
            with hub.lock:
                hub.log.append((method, path))
            body = self._body() if method in ("POST", "PUT") else b""
            try:
                self._route(method, path, body)
            except Exception as exc:  # surface server bugs as 500s in the client's error
                self._send(500, {"error": f"fake hub: {type(exc).__name__}: {exc}"})

        def do_GET(self) -> None:
            self._dispatch("GET")

        def do_HEAD(self) -> None:
            self._dispatch("HEAD")

        def do_POST(self) -> None:
            self._dispatch("POST")

        def do_PUT(self) -> None:
            self._dispatch("PUT")

        # -- routes --------------------------------------------------------------------------------------
        def _route(self, method: str, path: str, body: bytes) -> None:
            if method == "POST" and path == "/api/repos/create":
                return self._create_repo(json.loads(body))
            if method == "POST" and path == "/api/validate-yaml":
                return self._validate_yaml(json.loads(body))
            if method == "PUT" and path.startswith("/lfs-upload/"):
                oid = path.rsplit("/", 1)[1]
                if hashlib.sha256(body).hexdigest() != oid:
                    return self._send(400, {"error": "sha256 mismatch"})
                with hub.lock:
                    hub.lfs[oid] = body
                    hub.lfs_puts.append((oid, len(body)))
                return self._send(200, {})
            if (m := _LFS_BATCH.match(path)) and method == "POST":
                return self._lfs_batch(m["repo"], json.loads(body))
            if (m := _RESOLVE.match(path)) and method in ("GET", "HEAD"):
                return self._resolve(m["repo"], m["rev"], unquote(m["path"]), head=method == "HEAD")
            if m := _MODEL_API.match(path):
                repo = hub.repos.get(m["repo"])
                if repo is None:
                    return self._error(404, "RepoNotFound", "Repository not found")
                op = m["op"]
                if op == "preupload" and method == "POST":
                    return self._preupload(json.loads(body))
                if op == "commit" and method == "POST":
                    return self._commit(m["repo"], repo, unquote(m["rest"]), body)
                if op == "branch" and method == "POST":
                    return self._branch(repo, unquote(m["rest"]))
                if op == "tree" and method == "GET":
                    return self._tree(repo, m["rest"])
                if op == "revision" and method == "GET":
                    return self._info(m["repo"], repo, m["rest"])
            if (m := re.match(r"^/api/models/([^/]+/[^/]+)$", path)) and method == "GET":
                repo = hub.repos.get(m[1])
                if repo is None:
                    return self._error(404, "RepoNotFound", "Repository not found")
                return self._info(m[1], repo, "main")
            return self._send(404, {"error": f"fake hub has no route {method} {path}"})

        def _create_repo(self, payload: dict[str, Any]) -> None:
            if not self._authorized():
                return
            repo_id = f"{payload['organization']}/{payload['name']}" if payload.get("organization") else payload["name"]
            url = f"{hub.url}/{repo_id}"
            with hub.lock:
                if repo_id in hub.repos:
                    return self._send(409, {"error": "You already created this model repo", "url": url})
                sha = uuid.uuid4().hex + uuid.uuid4().hex[:8]
                hub.repos[repo_id] = Repo(
                    files={}, branches={"main": sha}, commits={sha: {}}, private=payload.get("visibility") == "private"
                )
            self._send(200, {"url": url, "name": repo_id})

        def _validate_yaml(self, payload: dict[str, Any]) -> None:
            content = payload["content"]
            hub.validated_yaml.append(content)
            match = re.match(r"^---\n(.*?)\n---\n", content, re.S)
            try:
                data = yaml.safe_load(match[1]) if match else None
            except yaml.YAMLError as exc:
                return self._send(400, {"errors": [{"message": str(exc)}]})
            if match and not isinstance(data, dict):
                return self._send(400, {"errors": [{"message": "metadata is not a mapping"}]})
            self._send(200, {"errors": [], "warnings": []})

        def _preupload(self, payload: dict[str, Any]) -> None:
            if not self._authorized():
                return
            files = [
                {
                    "path": f["path"],
                    "uploadMode": "lfs" if f["path"].endswith(".safetensors") else "regular",
                    "shouldIgnore": False,
                    "oid": None,
                }
                for f in payload["files"]
            ]
            self._send(200, {"files": files})

        def _lfs_batch(self, repo_id: str, payload: dict[str, Any]) -> None:
            if not self._authorized():
                return
            objects = []
            for obj in payload["objects"]:
                entry = {"oid": obj["oid"], "size": obj["size"]}
                if obj["oid"] not in hub.lfs:
                    entry["actions"] = {"upload": {"href": f"{hub.url}/lfs-upload/{obj['oid']}"}}
                objects.append(entry)
            self._send(200, {"transfer": "basic", "objects": objects})

        def _commit(self, repo_id: str, repo: Repo, revision: str, body: bytes) -> None:
            if not self._authorized():
                return
            lines = [json.loads(line) for line in body.splitlines() if line.strip()]
            hub.commit_payloads.append(lines)
            parent = repo.resolve(revision)
            if parent is None:
                return self._error(404, "RevisionNotFound", "Revision not found")
            files = dict(repo.commits[parent])
            for line in lines[1:]:
                value = line["value"]
                if line["key"] == "file":
                    files[value["path"]] = base64.b64decode(value["content"])
                elif line["key"] == "lfsFile":
                    if value["oid"] not in hub.lfs:
                        return self._send(400, {"error": f"LFS object {value['oid']} was never uploaded"})
                    files[value["path"]] = hub.lfs[value["oid"]]
                elif line["key"] == "deletedFile":
                    if value["path"] not in files:
                        return self._send(404, {"error": "A file with this name doesn't exist"})
                    del files[value["path"]]
            sha = uuid.uuid4().hex + uuid.uuid4().hex[:8]
            with hub.lock:
                repo.commits[sha] = files
                repo.branches[revision] = sha
            self._send(200, {"commitUrl": f"{hub.url}/{repo_id}/commit/{sha}", "commitOid": sha, "success": True})

        def _branch(self, repo: Repo, branch: str) -> None:
            if not self._authorized():
                return
            if branch in repo.branches:
                return self._send(409, {"error": "Branch already exists"})
            repo.branches[branch] = repo.branches["main"]
            self._send(200, {})

        def _tree(self, repo: Repo, rest: str) -> None:
            sha = repo.resolve(rest.split("/")[0])
            if sha is None:
                return self._error(404, "RevisionNotFound", "Revision not found")
            entries = [
                {"type": "file", "path": p, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                for p, b in sorted(repo.commits[sha].items())
            ]
            self._send(200, entries)

        def _info(self, repo_id: str, repo: Repo, revision: str) -> None:
            sha = repo.resolve(revision)
            if sha is None:
                return self._error(404, "RevisionNotFound", "Revision not found")
            siblings = [{"rfilename": p} for p in sorted(repo.commits[sha])]
            self._send(
                200, {"id": repo_id, "modelId": repo_id, "sha": sha, "private": repo.private, "siblings": siblings}
            )

        def _resolve(self, repo_id: str, revision: str, filename: str, head: bool) -> None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self._error(404, "RepoNotFound", "Repository not found", head=head)
            sha = repo.resolve(revision)
            if sha is None:
                return self._error(404, "RevisionNotFound", "Revision not found", head=head)
            content = repo.commits[sha].get(filename)
            if content is None:
                self._send(
                    404,
                    {"error": "Entry not found"},
                    {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": sha},
                    head=head,
                )
                return
            etag = f'"{hashlib.sha256(content).hexdigest()}"'
            self._send(200, content, {"X-Repo-Commit": sha, "ETag": etag}, head=head)

    return Handler
