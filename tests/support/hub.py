"""Pointing huggingface_hub at the local fake Hub (support/fakehub.py), and taking it offline again."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import constants

from tests.support.fakehub import TOKEN


def point_at(monkeypatch, endpoint: str, cache: Path) -> None:
    """Route huggingface_hub (read at import time into constants) to `endpoint`, online, with a fresh cache."""
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)  # plain LFS uploads, all to this endpoint
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(cache / "no-token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(cache / "no-stored-tokens"))
    monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(cache / "agent-harnesses.json"))
    monkeypatch.setenv("HF_TOKEN", TOKEN)


def go_offline(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
