"""More unlabelled training photos, offline: the photographs and artwork that Debian packages ship.

Eleven scikit-image photos are too few to train a conversion end to end (it fits them and loses held-out images).
Debian's desktop-wallpaper packages and OpenCV's sample data hold about 90 more: natural photographs (flowers,
forests, water, sky, boats), illustrations and gradients. `ensure_photo_packages` fetches each package with
`apt-get download` (apt checks it against the signed archive index; no root needed), unpacks it with
`dpkg-deb -x` in a staging folder and keeps only its images, downscaled to at most 1,024 px, in a cache folder
outside the repository (``$VCA_PATCH_PHOTOS_DIR``, default ``~/.cache/vca-patch/photos``). None of them is one of
the evaluation photos (`photos.EVALUATION_PHOTOS`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dinov2_weights.fetch import RealWeightsError, user_cache_dir
from dinov2_weights.photos import image_files, load_image_folder

CACHE_ENV = "VCA_PATCH_PHOTOS_DIR"
DEFAULT_TIMEOUT = 20.0  # seconds per network operation: an unreachable archive fails fast
MAX_SIDE = 1024
MIN_STD = 0.05  # flat images (a single colour, a faint gradient) teach nothing: skipped
_DONE = ".complete"
_DOWNLOAD_HINT = (
    "\nCheck the network / apt sources, or pass a folder of your own unlabelled images (--train-images DIR)."
)


class PhotosUnavailableError(RealWeightsError):
    """The photo packages could not be downloaded or unpacked."""


@dataclass(frozen=True)
class PhotoPackage:
    """A Debian package and where its images are: `folder` inside the package, optionally only `names` (stems)."""

    name: str
    folder: str
    names: tuple[str, ...] = ()


_OPENCV_PHOTOS = (
    "aero1", "aero3", "aloeL", "apple", "baboon", "basketball1", "box_in_scene", "building", "butterfly", "chicky_512",
    "ela_original", "fruits", "graf1", "home", "leuvenA", "licenseplate_motion", "messi5", "orange", "rubberwhale1",
    "smarties", "squirrel_cls", "starry_night", "stuff",
)  # fmt: skip
PHOTO_PACKAGES = (
    PhotoPackage("plasma-workspace-wallpapers", "usr/share/wallpapers"),
    PhotoPackage("mate-backgrounds", "usr/share/backgrounds/mate"),
    PhotoPackage("gnome-backgrounds", "usr/share/backgrounds/gnome"),
    PhotoPackage("ukui-wallpapers", "usr/share/backgrounds"),
    PhotoPackage("opencv-doc", "usr/share/doc/opencv-doc/examples/data", _OPENCV_PHOTOS),
)


def photo_cache_dir() -> Path:
    """$VCA_PATCH_PHOTOS_DIR, else $XDG_CACHE_HOME (or ~/.cache)/vca-patch/photos."""
    return user_cache_dir(CACHE_ENV, "photos")


def _image_key(path: Path, folder: Path) -> str:
    """One key per picture: a KDE wallpaper (`NAME/contents/images/WxH.jpg`) is NAME, any other file its stem
    before the first '_' (`Elephants_3840x2160.jpg` is Elephants), so only the largest size of each is kept."""
    parts = path.relative_to(folder).parts
    if "contents" in parts:
        return parts[parts.index("contents") - 1]
    return path.stem.split("_")[0] or path.stem


def select_images(folder: Path, names: Sequence[str] = ()) -> dict[str, Path]:
    """{key: the largest file} of the images under `folder`: one per picture (see `_image_key`), screenshots and
    dark variants left out; only the stems in `names` when given."""
    chosen: dict[str, Path] = {}
    for path in image_files(folder):
        if names:
            if path.stem not in names:
                continue
            key = path.stem
        else:
            if path.stem == "screenshot" or "images_dark" in path.parts:
                continue
            key = _image_key(path, folder)
        if key not in chosen or path.stat().st_size > chosen[key].stat().st_size:
            chosen[key] = path
    return chosen


def _run(cmd: list[str], timeout: float, cwd: Path, what: str, hint: str = "") -> None:
    """Run `cmd` in `cwd`; PhotosUnavailableError saying `what` failed (its output's last lines, then `hint`)."""
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise PhotosUnavailableError(f"{what} did not finish in {timeout:.0f} s{hint}") from None
    except OSError as exc:
        raise PhotosUnavailableError(f"cannot run {cmd[0]}: {exc}{hint}") from None
    if done.returncode != 0:
        tail = "\n  ".join((done.stderr or done.stdout).strip().splitlines()[-4:])
        raise PhotosUnavailableError(f"{what} failed (exit {done.returncode}):\n  {tail}{hint}")


def _unpack(deb: Path, package: PhotoPackage, dest: Path, staging: Path) -> int:
    """Unpack `deb` under `staging` and write its selected images, downscaled JPEGs, to `dest`; how many."""
    from PIL import Image

    root = staging / "root"
    _run(["dpkg-deb", "-x", str(deb), str(root)], 600.0, staging, f"dpkg-deb -x {deb.name}")
    folder = root / package.folder
    if not folder.is_dir():
        raise PhotosUnavailableError(f"{deb.name} has no folder {package.folder}: not the package this expects")
    dest.mkdir(parents=True)
    kept = 0
    for key, path in select_images(folder, package.names).items():
        with Image.open(path) as opened:
            image = opened.convert("RGB")
        image.thumbnail((MAX_SIDE, MAX_SIDE), Image.Resampling.BICUBIC)
        if np.asarray(image.convert("L"), dtype=np.float32).std() / 255.0 < MIN_STD:
            continue
        image.save(dest / f"{key}.jpg", quality=95)
        kept += 1
    return kept


def ensure_photo_packages(
    packages: Sequence[PhotoPackage] = PHOTO_PACKAGES, *, timeout: float = DEFAULT_TIMEOUT
) -> Path:
    """The cache folder, holding one subfolder of JPEGs per package, fetching and unpacking the missing ones first.

    A package's folder appears only once it is complete (it is written under a staging name, then renamed), so an
    interrupted fetch leaves nothing half-written. Raises PhotosUnavailableError, saying what to do instead, when
    apt-get or dpkg-deb is missing or a package cannot be downloaded.
    """
    root = photo_cache_dir()
    missing = [p for p in packages if not (root / p.name / _DONE).is_file()]
    if not missing:
        return root
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise PhotosUnavailableError(
                f"{tool} is not on this machine, so the Debian photo packages cannot be fetched; pass a folder "
                f"of your own unlabelled images instead (--train-images DIR), or unpack "
                f"{', '.join(p.name for p in missing)} into {root}/<package>/"
            )
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PhotosUnavailableError(f"cannot create the cache folder {root}: {exc}; set ${CACHE_ENV}") from None
    for package in missing:
        staging = Path(tempfile.mkdtemp(prefix=f".{package.name}-", dir=root))
        try:
            apt = [
                "apt-get", "download", "-q", "-o", "Acquire::Retries=0",
                "-o", f"Acquire::http::Timeout={timeout:.0f}", "-o", f"Acquire::https::Timeout={timeout:.0f}",
                package.name,
            ]  # fmt: skip
            _run(apt, 30 * timeout, staging, f"apt-get download {package.name}", _DOWNLOAD_HINT)
            debs = sorted(staging.glob("*.deb"))
            if len(debs) != 1:
                raise PhotosUnavailableError(f"apt-get download {package.name} left {len(debs)} .deb files")
            out = staging / "images"
            if _unpack(debs[0], package, out, staging) == 0:
                raise PhotosUnavailableError(f"{debs[0].name} held no usable image under {package.folder}")
            (out / _DONE).write_text(debs[0].name + "\n")
            shutil.rmtree(root / package.name, ignore_errors=True)  # an incomplete earlier copy
            os.replace(out, root / package.name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return root


def package_photos(
    packages: Sequence[PhotoPackage] = PHOTO_PACKAGES, *, timeout: float = DEFAULT_TIMEOUT
) -> dict[str, torch.Tensor]:
    """{"<package>/<picture>": float [3, H, W] in [0, 1]} of every cached package's images (fetched if missing)."""
    root = ensure_photo_packages(packages, timeout=timeout)
    photos: dict[str, torch.Tensor] = {}
    for package in packages:
        photos.update(load_image_folder(root / package.name, max_side=MAX_SIDE, prefix=f"{package.name}/"))
    return photos
