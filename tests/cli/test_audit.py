"""The field-fault audit, kept: every case of the issue's list (and the earlier audits' worst ones) run on tiny
random-weight models through one harness (tests/support/audit.py) with the same invariants: a non-zero exit, one
clean `error:` line naming the file and the field, every input byte-identical and nothing left behind.

Cases: --force refusals, bounded YAML and JSON, a model's own config sizes, recipe numbers, image files, checkpoints,
conflicting options and outputs that are devices, FIFOs, dangling links, over-long names or read-only folders."""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

import vca_patch
from tests.support.audit import Case, Scene, run_case
from tests.support.models import tiny
from vca_patch import VCAConfig, patch_model

ARGS = {"depth": 1, "img_size": 32, "patch_size": 8, "embed_dim": 16, "num_heads": 2, "num_classes": 3}
CONVERT = ["convert", "deit_tiny_patch16_224", "--no-pretrained", "--img-size", "32", "--contrast-tokens", "4"]
BENCH = ["bench", "deit_tiny_patch16_224", "--depth", "1", "--resolutions", "32", "--repeats", "1", "--warmup", "0",
         "--min-time", "0", "--no-memory", "--no-unfused"]  # fmt: skip
CPU = ["--device", "cpu"]
VIT = {"model_type": "vit", "architectures": ["ViTModel"], "hidden_size": 16, "num_hidden_layers": 1,
       "num_attention_heads": 2, "intermediate_size": 16, "image_size": 32, "patch_size": 8}  # fmt: skip
LAUGHS = "\n".join(
    ["name: r", 'a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
)
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """A converted tiny checkpoint (VCA, 32 px, 8 px patches, width 16), built once and copied into each case."""
    model, args = tiny(**ARGS)
    patch_model(model, VCAConfig(contrast_tokens=4))
    return {"ckpt": vca_patch.save_pretrained(model, tmp_path_factory.mktemp("audit") / "ckpt", model_args=args)}


# --- inputs -------------------------------------------------------------------------------------------------------


def _user_folder(s: Scene, name: str) -> Path:
    """A folder of the user's: a file and a sub-folder with a file."""
    s.write(f"{name}/notes.txt", "mine")
    s.write(f"{name}/Documents/thesis.tex", "\\documentclass{article}")
    return s.tmp / name


def _edit_config(s: Scene, edit) -> Path:
    """A copy of the checkpoint whose config.json went through `edit` (in place on the parsed dict)."""
    folder = s.copy("ckpt")
    meta = json.loads((folder / "config.json").read_text())
    edit(meta)
    (folder / "config.json").write_text(json.dumps(meta))
    return folder


def _model_args(**values):
    def edit(meta: dict) -> None:
        meta["model_args"].update(values)
        meta["base"]["model_args"].update(values)

    return edit


def _edit_weights(s: Scene, key: str, fn) -> Path:
    """A copy of the checkpoint whose tensor `key` went through `fn`."""
    folder = s.copy("ckpt")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors[key] = fn(tensors[key])
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _recipe(s: Scene, *, stage=None, train=None, data=None, text: str | None = None, name: str = "r.yaml") -> Path:
    body = {"name": "r", "stages": [{"name": "a", "kind": "distill", "steps": 10, **(stage or {})}]}
    body.update({"train": train} if train else {})
    body.update({"data": data} if data else {})
    return s.write(name, json.dumps(body) if text is None else text)  # JSON is YAML


def _finetune(s: Scene, recipe: Path) -> list[str]:
    return ["finetune", str(s.copy("ckpt")), "--recipe", str(recipe), "-o", str(s.tmp / "run"), *CPU]


def _vit_folder(s: Scene, text: str | None = None, **change) -> list[str]:
    """`convert` of a transformers folder holding only config.json (VIT with `change`, or `text`)."""
    s.write("vit/config.json", json.dumps({**VIT, **change}) if text is None else text)
    return ["convert", f"{s.tmp / 'vit'}/", "--no-pretrained", "-o", str(s.tmp / "out")]


def _images(s: Scene, root: str = "data", split: str = "test") -> Path:
    folder = s.tmp / root / split / "cat"
    folder.mkdir(parents=True)
    for i in range(2):
        Image.new("RGB", (8, 8), (60 * i, 90, 200)).save(folder / f"{i}.png")
    return s.tmp / root


def _fidelity_data(s: Scene, add) -> list[str]:
    """`fidelity` on the checkpoint with --data a small ImageFolder that `add` puts one bad entry into."""
    data = _images(s)
    add(data / "test" / "cat")
    return ["fidelity", str(s.copy("ckpt")), "--data", str(data), *CPU]


def _png(side: int):
    """An adder: a side×side PNG in a few bytes (its header says so, its pixel data is a stub), as bomb.png."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    def add(folder: Path) -> None:
        ihdr = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
        idat = zlib.compress(b"\0" * 64)
        png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
        (folder / "bomb.png").write_bytes(png)

    return add


def _huge_header(s: Scene) -> Path:
    folder = s.copy("ckpt")
    weights = folder / "model.safetensors"
    weights.write_bytes(struct.pack("<Q", 2**60) + weights.read_bytes()[8:])
    return folder


def _truncated_weights(s: Scene) -> Path:
    folder = s.copy("ckpt")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return folder


def _without(s: Scene, name: str) -> Path:
    folder = s.copy("ckpt")
    (folder / name).unlink()
    return folder


def _fifo(s: Scene, relative: str) -> Path:
    path = s.tmp / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


def _link(s: Scene, relative: str, target: Path) -> Path:
    link = s.tmp / relative
    link.symlink_to(target)
    return link


def _plan(s: Scene, text: str | None = None) -> Path:
    return s.write("p.json", text or json.dumps({"format": "vca-patch-plan", "version": 1, "config": {}}))


def _nan(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


# --- the cases ----------------------------------------------------------------------------------------------------


def _force_home(s: Scene) -> list[str]:
    home = _user_folder(s, "home")
    s.mp.setenv("HOME", str(home))
    return [*CONVERT, "-o", str(home), "--force"]


def _force_hub_cache(s: Scene) -> list[str]:
    snapshot = _user_folder(s, "hf/hub/models--acme--vit/snapshots/abc")
    s.mp.setenv("HF_HOME", str(s.tmp / "hf"))
    s.mp.setenv("HF_HUB_CACHE", str(s.tmp / "hf" / "hub"))
    return [*CONVERT, "-o", str(snapshot), "--force"]


def _force_symlink(s: Scene) -> list[str]:
    return [*CONVERT, "-o", str(_link(s, "link", s.copy("ckpt", "mine"))), "--force"]


def _force_checkpoint_and_user_file(s: Scene) -> list[str]:
    out = s.copy("ckpt", "out")
    (out / "notes.txt").write_text("mine")
    return [*CONVERT, "-o", str(out), "--force"]


def _force_downloaded(s: Scene) -> list[str]:
    for name in ("config.json", "model.safetensors", "README.md"):
        s.write(f"out/{name}", '{"architectures": ["ViTModel"]}')
    return [*CONVERT, "-o", str(s.tmp / "out"), "--force"]


def _force_weights_parent(s: Scene) -> list[str]:
    weights = s.write("models/w.safetensors", b"weights")
    return [*CONVERT, "--weights", str(weights), "-o", str(s.tmp / "models"), "--force"]


def _force_model_parent(s: Scene) -> list[str]:
    s.write("models/vit/config.json", json.dumps(VIT))
    return ["convert", str(s.tmp / "models" / "vit"), "--no-pretrained", "-o", str(s.tmp / "models"), "--force"]


def _mount_point(s: Scene):
    from vca_patch.core.atomic import check_output_dir

    mount = next(p for p in ("/proc", "/sys", "/dev") if os.path.ismount(p))
    return lambda: check_output_dir(Path(mount), overwrite=True)


def _export_over(s: Scene, make) -> list[str]:
    ckpt = s.copy("ckpt")
    s.write("notes.pt2", "my notes")
    return ["export", str(ckpt), "-o", str(make(s)), "--force"]


def _recursive_alias(s: Scene):
    from vca_patch.train.recipe import load_recipe

    path = _recipe(s, text="name: &n [1, *n]\nstages: []\n")
    return lambda: load_recipe(path)


def _img_size_mismatch(s: Scene) -> list[str]:
    (s.tmp / "images").mkdir()
    data = {"kind": "imagefolder", "path": str(s.tmp / "images"), "img_size": 64}
    return _finetune(s, _recipe(s, data=data))


def _nan_export_api(s: Scene):
    from vca_patch.export import export_model

    model, _ = tiny(**ARGS)
    with torch.no_grad():
        model.head.bias.fill_(float("nan"))
    return lambda: export_model(model, s.tmp / "m.pt2", dynamic=False)


def _dangling(s: Scene, relative: str) -> Path:
    return _link(s, relative, s.tmp / "gone")


def _ckpt_beside_dangling_json(s: Scene) -> Path:
    _dangling(s, "r.json")
    return s.copy("ckpt")


def _read_only(s: Scene) -> list[str]:
    locked = s.tmp / "locked"
    locked.mkdir(mode=0o500)
    return [*CONVERT, "-o", str(locked / "out")]


def _on(make, *command: str):
    """A setup: `command` with "{x}" replaced by the path `make(scene)` builds."""

    def setup(s: Scene) -> list[str]:
        made = str(make(s))
        return [a.replace("{x}", made) for a in command]

    return setup


def _config_text(data: str | bytes):
    """A maker: a copy of the checkpoint whose config.json holds `data` (text as UTF-8)."""

    def make(s: Scene) -> Path:
        folder = s.copy("ckpt")
        (folder / "config.json").write_bytes(data.encode() if isinstance(data, str) else data)
        return folder

    return make


def _config_fifo(s: Scene) -> Path:
    folder = _without(s, "config.json")
    os.mkfifo(folder / "config.json")
    return folder


def _force_cwd(s: Scene) -> list[str]:
    s.write("notes.txt", "mine")
    return [*CONVERT, "-o", ".", "--force"]


def _plan_with(*extra: str):
    return lambda s: [*CONVERT, "--plan", str(_plan(s)), *extra, "-o", str(s.tmp / "out")]


def _deep_plan(s: Scene) -> list[str]:
    plan = _plan(s, '{"format": "vca-patch-plan", "config": ' + "[" * 200 + "]" * 200 + "}")
    return [*CONVERT[:5], "--plan", str(plan), "-o", str(s.tmp / "out")]  # no --contrast-tokens: the plan says


def _model_is_a_file(s: Scene) -> list[str]:
    save_file({"a": torch.zeros(2)}, str(s.tmp / "w.safetensors"))
    return ["convert", str(s.tmp / "w.safetensors"), "--no-pretrained", "-o", str(s.tmp / "out")]


def _loop(folder: Path) -> None:
    (folder / "loop").symlink_to("..", target_is_directory=True)


def _calibration_loop(s: Scene) -> list[str]:
    data = _images(s, split="train")
    _images(s, split="test")  # the held-out split the conversion measures on
    _loop(data / "train" / "cat")
    return [*CONVERT, "--calibration-data", str(data), "--calibration-images", "2", "-o", str(s.tmp / "out")]


def _calibrate_grey(s: Scene):
    from vca_patch import calibrate

    model, _ = tiny(**ARGS)
    patch_model(model, VCAConfig(contrast_tokens=4))
    return lambda: calibrate(model, [torch.randn(2, 1, 32, 32)])


ROOT_WRITES = pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0o500 folder regardless")
LONG = "x" * 300  # one name of 300 bytes: over the 255 most file systems allow
HEAD = "head.weight"

CASES = [
    # --force replaces only what vca-patch wrote (each refused before any model is built)
    Case("force-home-folder", _force_home, r"output .*home is your home folder; .*new sub-folder", 2),
    Case("force-current-folder", _force_cwd, r"output \. is the current folder", 2),
    Case("force-hub-cache", _force_hub_cache, r"is inside the Hugging Face cache", 2),
    Case("force-symlink-to-a-folder", _force_symlink, r"link is a symbolic link to .*mine; it is never followed", 2),
    Case("force-non-vca-folder", lambda s: [*CONVERT, "-o", str(_user_folder(s, "out")), "--force"],
         r"holds what vca-patch did not write: Documents/, notes\.txt; --force replaces only", 2),
    Case("force-checkpoint-with-a-user-file", _force_checkpoint_and_user_file, r"did not write: notes\.txt", 2),
    Case("force-downloaded-model-folder", _force_downloaded,
         r"did not write: README\.md, config\.json, model\.safetensors", 2),
    Case("force-parent-of-weights", _force_weights_parent, r"holds the --weights file", 2),
    Case("force-parent-of-model-folder", _force_model_parent, r"models holds the MODEL folder", 2),
    Case("force-mount-point-api", _mount_point, r"is a filesystem root \(a mount point\)", 2),
    Case("export-force-symlink-to-a-file", lambda s: _export_over(s, lambda s: _link(s, "l.pt2", s.tmp / "notes.pt2")),
         r"l\.pt2 is a symbolic link", 2),
    Case("export-force-fifo", lambda s: _export_over(s, lambda s: _fifo(s, "nul.pt2")), r"nul\.pt2 is a FIFO", 2),
    Case("finetune-onto-its-checkpoint", lambda s: ["finetune", str(s.copy("ckpt")), "--recipe", str(_recipe(s)),
         "-o", str(s.tmp / "ckpt"), "--force"], r"is the converted checkpoint", 2),
    # bounded YAML
    Case("recipe-alias-bomb", lambda s: _finetune(s, _recipe(s, text=LAUGHS)),
         r"r\.yaml: line \d+: aliases expand to more than 100000 values", 2),
    Case("recipe-deep-nesting", lambda s: _finetune(s, _recipe(s, text=f"name: {DEEP}\n")),
         r"r\.yaml: line 1: nested more than 64 levels deep", 2),
    Case("recipe-recursive-alias-api", _recursive_alias, r"r\.yaml: line 1: alias \*n is inside its own anchor", 2),
    Case("recipe-over-1-mib", lambda s: _finetune(s, _recipe(s, text="name: r\n" + "#" * (1 << 20))),
         r"r\.yaml is larger than 1\.0 MiB", 2),
    Case("recipe-fifo", lambda s: _finetune(s, _fifo(s, "r.yaml")), r"r\.yaml is a FIFO \(named pipe\)", 2),
    # bounded JSON
    Case("config-json-deep-fidelity", _on(_config_text(DEEP), "fidelity", "{x}", *CPU),
         r"config\.json is nested more than 64 levels deep", 2),
    Case("config-json-over-16-mib", _on(_config_text(json.dumps({"pad": "x" * (17 << 20)})), "fidelity", "{x}", *CPU),
         r"config\.json is larger than 16\.0 MiB", 2),
    Case("config-json-fifo", _on(_config_fifo, "fidelity", "{x}", *CPU), r"config\.json is a FIFO", 2),
    Case("plan-json-deep", _deep_plan, r"p\.json: config\[0\]\[0\].* is nested more than 64 levels deep", 2),
    # a model's own config, sized before building
    Case("vit-image-size-65536", lambda s: _vit_folder(s, image_size=65536),
         r"vit/config\.json: image_size = 65536 is out of bounds: expected an integer from 1 to 16384", 2),
    Case("vit-patch-size-0", lambda s: _vit_folder(s, patch_size=0),
         r"vit/config\.json: patch_size = 0 is out of bounds", 2),
    Case("vit-heads-not-dividing-width", lambda s: _vit_folder(s, num_attention_heads=3),
         r"vit/config\.json: num_attention_heads = 3 does not divide hidden_size = 16", 2),
    Case("checkpoint-img-size-huge", _on(lambda s: _edit_config(s, _model_args(img_size=[60000, 60000])), "fidelity",
         "{x}", *CPU), r"model_args\.img_size = \[60000, 60000\].*from 1 to 16384", 2),
    Case("checkpoint-depth-huge", _on(lambda s: _edit_config(s, _model_args(depth=100000)), "export", "{x}"),
         r"model_args\.depth = 100000.*from 1 to 256", 2),
    # recipe numbers
    Case("recipe-negative-seed", lambda s: _finetune(s, _recipe(s, train={"seed": -1})),
         r"r\.yaml: train\.seed must be >= 0 and <= 4294967295, got -1", 2),
    Case("recipe-huge-steps", lambda s: _finetune(s, _recipe(s, stage={"steps": 10**30})),
         r"r\.yaml: stages\[0\]\.steps must be >= 1 and <= 10000000", 2),
    Case("recipe-negative-min-lr-ratio", lambda s: _finetune(s, _recipe(s, stage={"min_lr_ratio": -0.5})),
         r"r\.yaml: stages\[0\]\.min_lr_ratio must be >= 0\.0 and <= 1\.0", 2),
    Case("recipe-negative-kd-temperature", lambda s: _finetune(s, _recipe(s, stage={"kd_temperature": -2.0})),
         r"r\.yaml: stages\[0\]\.kd_temperature must be > 0 and <= 100\.0, got -2\.0", 2),
    Case("recipe-img-size-mismatch", _img_size_mismatch, r"data\.img_size is 64 px.*takes 32 px", 2),
    # image files
    Case("image-fifo-named-png", lambda s: _fidelity_data(s, lambda f: os.mkfifo(f / "x.png")),
         r"x\.png: it is a FIFO \(named pipe\), not a regular file", 2),
    Case("image-over-the-pixel-limit", lambda s: _fidelity_data(s, _png(12_000)),
         r"bomb\.png: it is 12000×12000 = 144000000 pixels, more than the 89478485", 2),
    Case("image-decompression-bomb", lambda s: _fidelity_data(s, _png(100_000)),
         r"bomb\.png: .*10000000000 pixels.*decompression bomb", 2),
    Case("data-folder-symlink-loop", lambda s: _fidelity_data(s, _loop),
         r"has a symbolic link loop: .*loop leads back to", 2),
    Case("calibration-data-symlink-loop", _calibration_loop, r"ImageFolder .*train has a symbolic link loop", 2),
    # checkpoints
    Case("checkpoint-truncated-weights", _on(_truncated_weights, "fidelity", "{x}", *CPU),
         r"model\.safetensors is not a readable safetensors file", 2),
    Case("checkpoint-huge-header-length", _on(_huge_header, "fidelity", "{x}", *CPU),
         r"model\.safetensors is not a readable safetensors file: its header claims 1152921504606846976 bytes", 2),
    Case("checkpoint-missing-weights", _on(lambda s: _without(s, "model.safetensors"), "export", "{x}"),
         r"is not a vca-patch checkpoint: missing model\.safetensors", 2),
    Case("model-path-is-a-file", _model_is_a_file, r"w\.safetensors is a file; a transformers model is a folder", 2),
    Case("weights-truncated", lambda s: [*CONVERT, "--weights", str(s.write("h.safetensors", b"\x10\0\0\0\0\0\0\0{")),
         "-o", str(s.tmp / "out")], r"h\.safetensors is not a readable safetensors file", 1),
    Case("checkpoint-nan-weights-fidelity", _on(lambda s: _edit_weights(s, HEAD, _nan), "fidelity", "{x}", *CPU),
         r"model\.safetensors: tensor head\.weight holds 48 NaN value\(s\) of 48", 2),
    Case("checkpoint-nan-weights-export", _on(lambda s: _edit_weights(s, HEAD, _nan), "export", "{x}"),
         r"model\.safetensors: tensor head\.weight holds 48 NaN value\(s\)", 2),
    Case("checkpoint-int8-weights", _on(lambda s: _edit_weights(s, HEAD, lambda t: t.to(torch.int8)), "fidelity",
         "{x}", *CPU), r"tensor head\.weight is int8, not floating point", 2),
    Case("export-check-not-finite-api", _nan_export_api, r"check against eager at 32x32 is not finite.*nothing was "
         "written", 2),
    Case("checkpoint-binary-config-push", _on(_config_text(bytes(range(256))), "push", "{x}", "a/b"),
         r"config\.json is not valid JSON", 2),
    Case("checkpoint-config-names-a-file-to-load", _on(lambda s: _edit_config(s, _model_args(
         checkpoint_path="/etc/passwd")), "fidelity", "{x}", *CPU), r"checkpoint_path", 2),
    Case("calibrate-grey-images-api", _calibrate_grey, r"has shape \(2, 1, 32, 32\), but the model takes images", 2),
    # options that conflict or would be ignored
    Case("plan-with-to", _plan_with("--to", "mano"), r"--plan .*p\.json already says what each block becomes.*--to "
         "mano.*would be ignored", 2),
    # outputs that are devices, FIFOs, dangling links, over-long names or read-only folders
    Case("bench-json-fifo", lambda s: [*BENCH, "--json", str(_fifo(s, "nul"))], r"--json .*nul is a FIFO", 2),
    Case("bench-json-dev-null", lambda s: [*BENCH, "--json", "/dev/null"], r"/dev/null is a character device", 2),
    Case("export-dev-null", _on(lambda s: s.copy("ckpt"), "export", "{x}", "-o", "/dev/null", "--force"),
         r"/dev/null .*character device", 2),
    Case("convert-dangling-symlink", lambda s: [*CONVERT, "-o", str(_dangling(s, "out"))],
         r"out is a symbolic link to .*gone", 2),
    Case("fidelity-json-dangling-symlink", _on(_ckpt_beside_dangling_json, "fidelity", "{x}", "--json", "r.json",
         *CPU), r"--json r\.json is a symbolic link to .*gone; vca-patch never writes through a link", 2),
    Case("convert-name-too-long", lambda s: [*CONVERT, "-o", str(s.tmp / LONG)], r"file name too long", 2),
    Case("export-name-too-long", _on(lambda s: s.copy("ckpt"), "export", "{x}", "-o", LONG + ".pt2"),
         r"file name too long", 2),
    Case("convert-img-size-not-whole-patches", lambda s: [*CONVERT[:3], "--img-size", "40", "-o", "out"],
         r"takes 40×40 px, not a whole number of 16×16 patches.*--img-size 32 or 48", 2),
    Case("convert-missing-parent-folder", lambda s: [*CONVERT, "-o", "nosuch/out"],
         r"cannot write -o nosuch/out: folder .*nosuch does not exist \(create it first\)", 2),
    Case("convert-read-only-folder", _read_only, r"not writable", 2, marks=(ROOT_WRITES,)),
]  # fmt: skip


def _changes_an_input(s: Scene):
    from vca_patch.core.errors import ConfigError

    notes = s.write("notes.txt", "mine")

    def call() -> None:
        notes.write_text("changed")
        raise ConfigError(f"{notes} is bad")

    return call


def _leaves(name: str):
    def setup(s: Scene):
        from vca_patch.core.errors import ConfigError

        def call() -> None:
            (s.tmp / name).write_text("half")
            raise ConfigError("bad input")

        return call

    return setup


def _internal_error(s: Scene) -> list[str]:
    import vca_patch.cli.fidelity as fidelity_cli

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    s.mp.setattr(fidelity_cli, "resolve_device", boom)
    return ["fidelity", str(s.copy("ckpt"))]


BROKEN = [  # (case, what the harness must say): each breaks one invariant, so run_case must fail on it
    (Case("exit-0", lambda s: ["version"], r"."), r"exit 0"),
    (Case("internal-error", _internal_error, r"."), r"not one clean line"),
    (Case("other-needle", lambda s: [*CONVERT, "-o", "nosuch/out"], r"file name too long"), r"not in: error:"),
    (Case("other-code", lambda s: [*CONVERT, "-o", "nosuch/out"], r"nosuch", 1), r"exit 2, not 1"),
    (Case("not-a-vca-patch-error", lambda s: lambda: int("x"), r"."), r"not a vca-patch error: ValueError"),
    (Case("returns", lambda s: lambda: None, r"."), r"returned without an error"),
    (Case("input-changed", _changes_an_input, r"is bad"), r"inputs changed or removed: \['notes\.txt'\]"),
    (Case("left-behind", _leaves("out.tmp-1"), r"bad"), r"left behind: \['out\.tmp-1'\]"),
]


@pytest.mark.parametrize(("case", "says"), BROKEN, ids=[c.id for c, _ in BROKEN])
def test_the_harness_fails_a_case_that_breaks_an_invariant(case, says, tmp_path, sources):
    with pytest.raises((AssertionError, pytest.fail.Exception), match=says):
        run_case(case, tmp_path, sources)


def test_an_entry_a_case_expects_is_not_a_leftover(tmp_path):
    assert run_case(Case("leaves", _leaves("out.tmp-1"), r"bad input", 2, leaves=("*.tmp-*",)), tmp_path) == (
        "error: bad input"
    )


def test_the_case_ids_are_unique():
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", [c.param() for c in CASES])
def test_one_clean_line_inputs_unchanged_nothing_left(case: Case, tmp_path, sources):
    run_case(case, tmp_path, sources)
