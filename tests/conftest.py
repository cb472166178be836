import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# CLI output is checked for whole phrases: one wide console width for every test, whatever the worker's stdout is
# (tests of the 80-column layout and of the piped default set or clear COLUMNS themselves).
os.environ.setdefault("COLUMNS", "200")

import pytest
import torch

# One thread per pytest-xdist worker (make test runs two), else up to two.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def connections(monkeypatch):
    """Addresses of every TCP connection attempted during the test (fail-fast checks count them, not seconds)."""
    import socket

    attempts: list = []
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def connect(sock, address):
        attempts.append(address)
        return real_connect(sock, address)

    def connect_ex(sock, address):
        attempts.append(address)
        return real_connect_ex(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    return attempts


# Helper modules whose checks use plain `assert`: pytest rewrites them for readable failures.
pytest.register_assert_rewrite("tests.support.hierarchical")


@pytest.fixture
def diffusers_loadable(monkeypatch):
    """The diffusers adapter is loadable from config.json (its library declares its base check); kept for the
    tests that request it."""
    from vca_patch.families import loadable_adapters

    assert loadable_adapters()["diffusers-dit"].name == "diffusers"


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A fake Hub on 127.0.0.1 (tests/support/fakehub.py), huggingface_hub pointed at it online, fresh cache."""
    from tests.support.fakehub import FakeHub
    from tests.support.hub import point_at

    fake = FakeHub().start()
    point_at(monkeypatch, fake.url, tmp_path / "hf-cache")
    yield fake
    fake.stop()
