"""Every network call has a timeout and says which endpoint did not answer: an endpoint on 127.0.0.1 that accepts
connections and never answers (or answers the first request only) ends `push`, `convert` of a Hub id and
`from_pretrained` of a repo id in one `error:` line naming it, within seconds; offline mode still asks no endpoint."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
from huggingface_hub import constants

import vca_patch
from tests.support.cli import one_error_line, run_unchanged
from tests.support.hub import point_at
from tests.support.models import tiny
from vca_patch import VCAConfig, patch_model
from vca_patch.cli.errors import report
from vca_patch.core import hub_access
from vca_patch.hub import HubUnavailableError

REPO = "acme/never-answered"
TIMEOUT = 1  # seconds, for each Hub request in these tests


class SilentEndpoint:
    """A TCP server on 127.0.0.1 that accepts every connection and never sends a byte; with `answer_first`, the
    first request (vca-patch's probe that the endpoint answers) gets an empty HTTP 200, and no later one."""

    def __init__(self, answer_first: bool = False) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.answer_first = answer_first
        self.accepted = 0
        self.answered = False
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed by stop()
                return
            self.accepted += 1
            self.held.append(conn)
            if self.answer_first and not self.answered and conn.recv(65536):  # a bare TCP check sends nothing
                self.answered = True
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                conn.close()

    def __enter__(self) -> SilentEndpoint:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.fixture
def silent(monkeypatch, tmp_path) -> Iterator[SilentEndpoint]:
    """huggingface_hub pointed at a silent endpoint, online, with 1 s timeouts and no endpoint remembered."""
    with SilentEndpoint() as endpoint:
        _point(monkeypatch, tmp_path, endpoint)
        yield endpoint


def _point(monkeypatch, tmp_path: Path, endpoint: SilentEndpoint) -> None:
    point_at(monkeypatch, endpoint.url, tmp_path / "hf-cache")
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", TIMEOUT)
    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", TIMEOUT)
    monkeypatch.setattr(hub_access, "_probed", {})


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    model, args = tiny()
    patch_model(model, VCAConfig(contrast_tokens=4))
    return vca_patch.save_pretrained(model, tmp_path / "ckpt", model_args=args, metadata={"base_weights": "pretrained"})


def _names_endpoint(line: str, url: str) -> None:
    assert url in line and "HF_ENDPOINT" in line and "HF_HUB_OFFLINE=1" in line, line


def test_push_to_an_endpoint_that_never_answers_is_one_line_naming_it(silent, checkpoint):
    start = time.monotonic()
    result = run_unchanged(["push", str(checkpoint), REPO], [checkpoint])
    line = one_error_line(result, 1, "did not answer within 1 s", "nothing was uploaded")
    _names_endpoint(line, silent.url)
    assert time.monotonic() - start < 20


def test_convert_of_a_hub_id_from_an_endpoint_that_never_answers_is_one_line(silent, tmp_path):
    start = time.monotonic()
    result = run_unchanged(["convert", REPO, "-o", str(tmp_path / "out")], [])
    _names_endpoint(one_error_line(result, 1, "did not answer within 1 s"), silent.url)
    assert not (tmp_path / "out").exists()
    assert time.monotonic() - start < 20


def test_from_pretrained_of_a_repo_id_says_which_endpoint_did_not_answer(silent, monkeypatch):
    start = time.monotonic()
    with pytest.raises(HubUnavailableError) as caught:
        vca_patch.from_pretrained(REPO)
    _names_endpoint(str(caught.value), silent.url)
    assert time.monotonic() - start < 20
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 60)  # a second wait would now take a minute
    again = time.monotonic()
    with pytest.raises(HubUnavailableError, match="did not answer within 1 s"):  # remembered, not waited for again
        vca_patch.from_pretrained(REPO)
    assert time.monotonic() - again < 10


def test_a_push_that_stalls_after_the_probe_ends_at_the_timeout(monkeypatch, tmp_path, checkpoint):
    """create_repo and upload_folder send no timeout of their own: the session's bound ends them."""
    with SilentEndpoint(answer_first=True) as endpoint:
        _point(monkeypatch, tmp_path, endpoint)
        start = time.monotonic()
        with pytest.raises(HubUnavailableError) as caught:
            vca_patch.push_to_hub(checkpoint, REPO)
        assert time.monotonic() - start < 20
        assert endpoint.answered and endpoint.accepted >= 3  # TCP check, probe answered, the Hub call after it not
    message = str(caught.value)
    assert f"the Hub endpoint {endpoint.url} did not answer in time (ReadTimeout)" in message, message
    assert "nothing local was changed" in message


def test_offline_mode_fails_fast_without_asking_the_endpoint(silent, checkpoint, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    start = time.monotonic()
    result = run_unchanged(["push", str(checkpoint), REPO], [checkpoint])
    one_error_line(result, 1, "HF_HUB_OFFLINE is set")
    assert time.monotonic() - start < 5 and silent.accepted == 0


def test_a_library_timeout_that_reaches_the_boundary_is_one_line_naming_its_endpoint(capsys):
    request = httpx2.Request("HEAD", "https://hub.example:8443/acme/m/resolve/main/config.json")
    try:
        try:
            raise httpx2.ReadTimeout("timed out", request=request)
        except httpx2.ReadTimeout as exc:
            raise OSError("We couldn't connect to the Hub to load this file") from exc  # as transformers does
    except OSError as wrapped:
        assert report(wrapped) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the Hub endpoint https://hub.example:8443 did not answer in time (ReadTimeout)")
    assert "HF_HUB_OFFLINE=1" in err and len(err.splitlines()) == 1


def test_timeout_defaults_keep_what_the_user_set(monkeypatch):
    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "77")
    monkeypatch.delenv("HF_HUB_ETAG_TIMEOUT", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", 77)
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", constants.DEFAULT_ETAG_TIMEOUT)
    hub_access.set_hub_timeout_defaults()
    assert os.environ["HF_HUB_DOWNLOAD_TIMEOUT"] == "77" and constants.HF_HUB_DOWNLOAD_TIMEOUT == 77
    assert os.environ["HF_HUB_ETAG_TIMEOUT"] == "10" and constants.HF_HUB_ETAG_TIMEOUT == 10


def test_a_request_without_a_timeout_gets_the_hubs_and_none_waits_longer(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 2)
    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", 5)
    unbounded = httpx2.Request("POST", "https://hub.example/api/repos/create", extensions={"timeout": {}})
    hub_access._bound_request(unbounded)
    assert unbounded.extensions["timeout"] == {"connect": 2.0, "read": 5.0, "write": 5.0, "pool": 5.0}
    sixty = dict.fromkeys(("connect", "read", "write", "pool"), 60.0)  # huggingface_hub's metadata retry
    retry = httpx2.Request("HEAD", "https://hub.example/x", extensions={"timeout": sixty})
    hub_access._bound_request(retry)
    assert retry.extensions["timeout"] == {"connect": 2.0, "read": 5.0, "write": 5.0, "pool": 5.0}


@pytest.mark.e2e
def test_the_command_ends_within_seconds_with_its_own_timeouts(tmp_path, checkpoint):
    """The `vca-patch` process itself (its start-up sets the timeouts), with HF_HUB_ETAG_TIMEOUT=1 and a fake token."""
    with SilentEndpoint() as endpoint:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_ENDPOINT": endpoint.url, "HF_HUB_OFFLINE": "0",
               "HF_TOKEN": "hf_fake", "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_ETAG_TIMEOUT": "1"}  # fmt: skip
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "vca_patch", "push", str(checkpoint), REPO], env=env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        took = time.monotonic() - start
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), done.stderr
    _names_endpoint(lines[0], endpoint.url)
    assert took < 20, took
