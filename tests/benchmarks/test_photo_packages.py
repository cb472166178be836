"""Training photos beyond scikit-image's: folders of images, fresh random crops, and Debian's photo packages
(fetched with apt-get, unpacked with dpkg-deb). The packages here are built by the test and handed out by a
stand-in apt-get on PATH, so nothing is downloaded."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from dinov2_weights.photo_packages import (
    CACHE_ENV,
    PhotoPackage,
    PhotosUnavailableError,
    ensure_photo_packages,
    package_photos,
    select_images,
)
from dinov2_weights.photos import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    PhotoCrops,
    load_image_folder,
    normalize,
    random_crops,
)

PIL = pytest.importorskip("PIL.Image")


def _save(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    PIL.fromarray(array).save(path)


def _noise(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def test_load_image_folder_reads_downscales_and_refuses_bad_files(tmp_path):
    _save(tmp_path / "a.png", _noise(40, 80, 0))
    _save(tmp_path / "sub" / "b.jpg", np.full((30, 30), 128, dtype=np.uint8))  # grey -> RGB
    (tmp_path / "notes.txt").write_text("not an image")
    photos = load_image_folder(tmp_path, max_side=20, prefix="x/")
    assert sorted(photos) == ["x/a", "x/sub/b"]
    assert photos["x/a"].shape == (3, 10, 20)  # the longer side now 20
    assert photos["x/sub/b"].shape == (3, 20, 20)
    assert torch.allclose(photos["x/sub/b"], torch.full_like(photos["x/sub/b"], 128 / 255), atol=2 / 255)
    original = torch.from_numpy(_noise(40, 80, 0)).permute(2, 0, 1).float() / 255
    assert torch.equal(load_image_folder(tmp_path, max_side=100)["a"], original)  # lossless PNG, not resized

    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8 truncated")
    with pytest.raises(ValueError, match=r"cannot read image .*broken\.jpg"):
        load_image_folder(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no images"):
        load_image_folder(tmp_path / "empty")
    with pytest.raises(ValueError, match="not a folder"):
        load_image_folder(tmp_path / "missing")


def _red_corner(images: torch.Tensor) -> torch.Tensor:
    """The red value of the top-left pixel of normalised images [..., 3, H, W], back in [0, 1]: which constant photo a
    crop came from."""
    return images[..., 0, 0, 0] * IMAGENET_STD[0] + IMAGENET_MEAN[0]


def test_photo_crops_draw_every_photo_and_are_deterministic():
    photos = {f"p{i}": torch.full((3, 32, 48), i / 10) for i in range(10)}
    crops = PhotoCrops(photos, 16, 200, seed=3)
    x = torch.stack([crops[i][0] for i in range(len(crops))])
    assert x.shape == (200, 3, 16, 16) and crops[5][1] == 0
    # each crop is one constant photo: which photo it came from is its (normalised) value
    drawn = {round(float(v), 3) for v in _red_corner(x)}
    assert len(drawn) == 10  # all ten photos, not the first eight as cycling in name order gives a batch of 8
    first_batch = {round(float(v), 3) for v in _red_corner(x[:8])}
    assert len(first_batch) > 1
    cycled = random_crops(photos, 8, 16, seed=3)
    assert {round(float(v), 3) for v in _red_corner(cycled)} == {i / 10 for i in range(8)}
    assert torch.equal(PhotoCrops(photos, 16, 200, seed=3)[7][0], crops[7][0])
    other = torch.stack([PhotoCrops(photos, 16, 200, seed=4)[i][0] for i in range(8)])
    assert not torch.equal(other, x[:8])  # another seed, other crops
    with pytest.raises(IndexError):
        crops[200]
    with pytest.raises(ValueError, match="no photos"):
        PhotoCrops({}, 16, 4)


def test_photo_crops_weights_set_each_photos_share_of_the_crops():
    photos = {f"p{i}": torch.full((3, 24, 24), i / 10) for i in range(4)}
    weights = {"p0": 6.0, "p1": 2.0, "p2": 1.0, "p3": 1.0}
    crops = PhotoCrops(photos, 8, 4000, seed=0, weights=weights)
    drawn = torch.tensor([round(float(_red_corner(crops[i][0])) * 10) for i in range(len(crops))])
    shares = torch.bincount(drawn, minlength=4).double() / len(crops)  # [4]
    expected = torch.tensor([0.6, 0.2, 0.1, 0.1], dtype=torch.float64)
    # binomial standard error <= 0.008 at n = 4000: 4 of them
    assert torch.allclose(shares, expected, atol=0.03), shares
    assert torch.equal(PhotoCrops(photos, 8, 4000, seed=0, weights=weights)[11][0], crops[11][0])  # deterministic
    # without weights the draw is the uniform one it always was (item i: randint, generator seeded with i at seed 0)
    uniform = PhotoCrops(photos, 8, 10, seed=0)
    for i in range(10):
        drawn_before = int(torch.randint(0, 4, (), generator=torch.Generator().manual_seed(i)))
        assert round(float(_red_corner(uniform[i][0])) * 10) == drawn_before
    for bad, match in (({"p0": 1.0}, "missing"), ({**weights, "p9": 1.0}, "unknown"), ({**weights, "p1": 0.0}, "> 0"),
                       ({**weights, "p2": float("nan")}, "finite")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            PhotoCrops(photos, 8, 10, weights=bad)


def test_photo_crops_flip_and_crop_real_content():
    ramp = torch.linspace(0, 1, 64).expand(3, 64, 64).contiguous()  # brightness grows left to right
    crops = PhotoCrops({"ramp": ramp}, 32, 64, seed=0, scale=(1.0, 1.0))
    slopes = [float(crops[i][0][0, 16, -1] - crops[i][0][0, 16, 0]) for i in range(64)]
    assert any(s > 0 for s in slopes) and any(s < 0 for s in slopes)  # both orientations drawn
    unflipped = PhotoCrops({"ramp": ramp}, 32, 64, seed=0, scale=(1.0, 1.0), flip=False)
    assert all(float(unflipped[i][0][0, 16, -1] - unflipped[i][0][0, 16, 0]) > 0 for i in range(64))
    whole = normalize(ramp)[0, 32]
    assert float(unflipped[0][0][0, 16].min()) >= float(whole.min()) - 1e-4


def test_select_images_keeps_one_picture_each(tmp_path):
    kde = tmp_path / "usr/share/wallpapers/Path/contents"
    _save(kde / "images" / "1920x1080.jpg", _noise(20, 30, 1))
    _save(kde / "images" / "5120x2880.jpg", _noise(40, 60, 2))  # larger: kept
    _save(kde / "images_dark" / "5120x2880.jpg", _noise(80, 80, 3))
    _save(kde / "screenshot.jpg", _noise(90, 90, 4))
    _save(tmp_path / "usr/share/wallpapers/Elephants_3840x2160.jpg", _noise(20, 20, 5))
    _save(tmp_path / "usr/share/wallpapers/Elephants_5640x3172.jpg", _noise(50, 50, 6))
    chosen = select_images(tmp_path / "usr/share/wallpapers")
    assert sorted(chosen) == ["Elephants", "Path"]
    assert chosen["Path"].name == "5120x2880.jpg" and "images_dark" not in chosen["Path"].parts
    assert chosen["Elephants"].name == "Elephants_5640x3172.jpg"
    assert sorted(select_images(tmp_path / "usr/share/wallpapers", ("Elephants_3840x2160",))) == ["Elephants_3840x2160"]


def _build_deb(tmp_path: Path, name: str, images: dict[str, np.ndarray]) -> Path:
    root = tmp_path / f"build-{name}"
    for rel, array in images.items():
        _save(root / rel, array)
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text(
        f"Package: {name}\nVersion: 1.0\nArchitecture: all\nMaintainer: test <t@example.org>\nDescription: test\n"
    )
    deb = tmp_path / f"{name}_1.0_all.deb"
    subprocess.run(["dpkg-deb", "--build", "--root-owner-group", str(root), str(deb)], check=True, capture_output=True)
    return deb


@pytest.fixture
def fake_apt(tmp_path, monkeypatch):
    """A stand-in apt-get on PATH: `apt-get download NAME` copies debs/NAME_*.deb into its working folder; a name
    without a deb fails as apt does offline."""
    if shutil.which("dpkg-deb") is None:
        pytest.skip("dpkg-deb is not on this machine")
    bindir, debs = tmp_path / "bin", tmp_path / "debs"
    bindir.mkdir()
    debs.mkdir()
    script = bindir / "apt-get"
    script.write_text(
        "#!/bin/sh\n"
        "for last; do :; done\n"
        f'f=$(ls {debs}/"$last"_*.deb 2>/dev/null) || {{ echo "E: Failed to fetch $last  Temporary failure '
        'resolving deb.debian.org" >&2; exit 100; }\n'
        'cp "$f" .\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return debs


def test_packages_are_fetched_unpacked_and_cached(fake_apt, tmp_path):
    deb = _build_deb(tmp_path, "photos-a", {
        "usr/share/pics/Forest/contents/images/800x600.jpg": _noise(60, 80, 7),
        "usr/share/pics/Forest/contents/screenshot.jpg": _noise(60, 80, 8),
        "usr/share/pics/flat.png": np.full((50, 50, 3), 90, dtype=np.uint8),  # flat: skipped
        "usr/share/pics/big.png": _noise(300, 2100, 9),  # downscaled to 1,024 px
        "usr/share/other/elsewhere.png": _noise(20, 20, 10),  # outside the package's folder
    })  # fmt: skip
    shutil.move(deb, fake_apt / deb.name)
    package = PhotoPackage("photos-a", "usr/share/pics")
    photos = package_photos((package,))
    assert sorted(photos) == ["photos-a/Forest", "photos-a/big"]
    assert photos["photos-a/big"].shape[1:] == (146, 1024)
    cache = tmp_path / "cache"
    assert sorted(p.name for p in (cache / "photos-a").iterdir()) == [".complete", "Forest.jpg", "big.jpg"]
    assert [p.name for p in cache.iterdir()] == ["photos-a"]  # no staging folder left
    (fake_apt / deb.name).unlink()  # cached: no second download
    assert ensure_photo_packages((package,)) == cache


def test_offline_fails_clearly_and_writes_nothing(fake_apt, tmp_path):
    expected = r"(?s)apt-get download photos-b failed.*Temporary failure.*--train-images DIR"
    with pytest.raises(PhotosUnavailableError, match=expected):
        ensure_photo_packages((PhotoPackage("photos-b", "usr/share/pics"),))
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_package_without_the_folder_is_refused(fake_apt, tmp_path):
    deb = _build_deb(tmp_path, "photos-c", {"usr/share/elsewhere/a.png": _noise(20, 20, 11)})
    shutil.move(deb, fake_apt / deb.name)
    with pytest.raises(PhotosUnavailableError, match="has no folder usr/share/pics"):
        ensure_photo_packages((PhotoPackage("photos-c", "usr/share/pics"),))
    assert list((tmp_path / "cache").iterdir()) == []


def test_missing_tools_say_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # neither apt-get nor dpkg-deb
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(PhotosUnavailableError, match=r"apt-get is not on this machine.*--train-images DIR"):
        ensure_photo_packages((PhotoPackage("photos-d", "usr/share/pics"),))
