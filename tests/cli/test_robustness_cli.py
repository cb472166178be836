"""Nothing lost, nothing crashes: every command with each bad input exits with its code and one `error:` line
(no traceback), and leaves every input file byte for byte as it was."""

import importlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import vca_patch
from tests.support.cli import one_error_line, run_unchanged, runner
from tests.support.models import tiny
from tests.support.paths import RECIPES
from vca_patch import patch_model
from vca_patch.cli import app

finetune_module = importlib.import_module("vca_patch.train.finetune")  # the module (the package re-exports a function)
classification_task = importlib.import_module("vca_patch.train.tasks.classification")
RECIPE = RECIPES / "fashion_mnist.yaml"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A converted checkpoint, its truncated / older / newer copies, and weights files that are not weights."""
    root = tmp_path_factory.mktemp("inputs")
    model, args = tiny()
    patch_model(model)
    good = vca_patch.save_pretrained(model, root / "ckpt", model_args=args)
    out = {"ckpt": good}
    for name, edit in {
        "older": {"format_version": 0},
        "newer": {"format_version": 2, "vca_patch_version": "0.9.0"},
    }.items():
        folder = root / name
        folder.mkdir()
        for f in good.iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
        meta = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**meta, **edit}))
        out[name] = folder
    truncated = root / "truncated"
    truncated.mkdir()
    for f in good.iterdir():
        data = f.read_bytes()
        (truncated / f.name).write_bytes(data[: len(data) // 2] if f.name == "model.safetensors" else data)
    out["truncated"] = truncated
    (root / "text.safetensors").write_text("not tensors")
    (root / "text.pth").write_text("not tensors")
    save_file({"w": torch.ones(4)}, str(root / "half.safetensors"))
    data = (root / "half.safetensors").read_bytes()
    (root / "half.safetensors").write_bytes(data[: len(data) - 8])
    out.update(
        {n: root / f"{n}.{e}" for n, e in (("text", "safetensors"), ("textpth", "pth"), ("half", "safetensors"))}
    )
    out["textpth"] = root / "text.pth"
    out["root"] = root
    unsafe = root / "unsafe"  # a checkpoint whose config.json the loading guard refuses
    unsafe.mkdir()
    for f in good.iterdir():
        (unsafe / f.name).write_bytes(f.read_bytes())
    meta = json.loads((unsafe / "config.json").read_text())
    meta["base"]["model_args"]["checkpoint_path"] = "/etc/passwd"
    (unsafe / "config.json").write_text(json.dumps(meta))
    out["unsafe"] = unsafe
    images = root / "images" / "test" / "cat"  # an ImageFolder --data with one image in its test split
    images.mkdir(parents=True)
    from PIL import Image

    Image.new("RGB", (8, 8), (200, 10, 10)).save(images / "a.png")
    out["images"] = root / "images"
    out["image"] = images / "a.png"
    out.update(_size_inputs(root, good))
    return out


def _size_inputs(root: Path, good: Path) -> dict[str, Path]:
    """Checkpoints whose config.json asks for absurd sizes, plan files that do not fit deit_tiny at 224 px, and a
    recipe with a negative worker count."""
    import yaml

    from vca_patch.targets.merge import MergeConfig

    out = {}
    for name, key, value in (("big_img", "img_size", [60000, 60000]), ("deep", "depth", 100000)):
        folder = root / name
        folder.mkdir()
        for f in good.iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
        meta = json.loads((folder / "config.json").read_text())
        meta["model_args"][key] = meta["base"]["model_args"][key] = value
        (folder / "config.json").write_text(json.dumps(meta))
        out[name] = folder
    made_448 = {"depth": 12, "dim": 192, "num_heads": 3, "resolution": 448}
    for name, config, model in (
        ("plan_448", MergeConfig(schedule=[8] * 4), made_448),
        ("plan_n", MergeConfig(schedule=[0, 8], vca_layers={0: 1000000}), None),
        ("plan_many", MergeConfig(schedule=[100] * 12), None),
    ):
        body = {"format": "vca-patch-plan", "version": 1, "config": config.to_dict()}
        (root / f"{name}.json").write_text(json.dumps(body | ({"model": model} if model else {})))
        out[name] = root / f"{name}.json"
    recipe = yaml.safe_load(RECIPE.read_text())
    recipe["data"]["num_workers"] = -1
    (root / "workers.yaml").write_text(yaml.safe_dump(recipe))
    out["recipe_workers"] = root / "workers.yaml"
    return out


BENCH = ["bench", "--repeats", "1", "--warmup", "0", "--min-time", "0", "--no-memory", "--no-unfused"]
CASES = [  # (id, args with {name} placeholders, input names, exit code, substrings of the error line)
    ("bench-not-a-vit", [*BENCH, "resnet18", "--resolutions", "64"], [], 2, ["resnet18 is not a ViT-style"]),
    ("bench-resolution", [*BENCH, "deit_tiny_patch16_224", "--depth", "1", "--resolutions", "100,224"], [], 2,
     ["100 px are not a multiple of the patch size 16×16", "use e.g. 96"]),
    ("bench-batch-0", [*BENCH, "deit_tiny_patch16_224", "--batch", "0"], [], 2, ["--batch must be at least 1"]),
    ("bench-depth-0", [*BENCH, "deit_tiny_patch16_224", "--depth", "0"], [], 2,
     ["--depth must be an integer from 1 to 256"]),
    ("fidelity-limit-0", ["fidelity", "{ckpt}", "--limit", "0"], ["ckpt"], 2, ["--limit must be at least 1"]),
    ("fidelity-batch-0", ["fidelity", "{ckpt}", "--batch-size", "0"], ["ckpt"], 2, ["--batch-size must be"]),
    ("fidelity-truncated", ["fidelity", "{truncated}", "--device", "cpu"], ["truncated"], 2,
     ["model.safetensors is not a readable safetensors file", "download or export it again"]),
    ("fidelity-older", ["fidelity", "{older}", "--device", "cpu"], ["older"], 2,
     ["has format 0", "convert the original model again"]),
    ("fidelity-newer", ["fidelity", "{newer}", "--device", "cpu"], ["newer"], 2,
     ["written by vca-patch 0.9.0 (format 2)", "'vca-patch>=0.9.0'", "source tree"]),
    ("push-truncated", ["push", "{truncated}", "acme/model"], ["truncated"], 2,
     ["does not load, so nothing was pushed", "not a readable safetensors file"]),
    ("convert-text-safetensors", ["convert", "deit_tiny_patch16_224", "--weights", "{text}", "-o", "{out}"],
     ["text"], 1, ["text.safetensors is not a readable safetensors file"]),
    ("convert-text-pth", ["convert", "deit_tiny_patch16_224", "--weights", "{textpth}", "-o", "{out}"],
     ["textpth"], 1, ["text.pth is not a readable torch checkpoint"]),
    ("convert-truncated", ["convert", "deit_tiny_patch16_224", "--weights", "{half}", "-o", "{out}"],
     ["half"], 1, ["half.safetensors is not a readable safetensors file"]),
    ("convert-out-holds-weights", ["convert", "deit_tiny_patch16_224", "--weights", "{root}/text.pth", "-o",
     "{root}", "--force"], ["root"], 2, ["holds the --weights file"]),
    ("convert-option-of-other-target", ["convert", "deit_tiny_patch16_224", "--no-pretrained", "--to", "mano",
     "--contrast-tokens", "50", "-o", "{out}"], [], 2, ["--contrast-tokens is for --to vca, not --to mano"]),
    ("convert-hub-hint-without-given-option", ["convert", "google/vit-base-patch16-224", "--no-pretrained", "-o",
     "{out}"], [], 1, ["unreachable", "also with --no-pretrained"]),
    ("convert-split-without-data", ["convert", "deit_tiny_patch16_224", "--no-pretrained", "--split", "calib", "-o",
     "{out}"], [], 2, ["--split choose splits of --calibration-data"]),
    ("convert-probe-size-0", ["convert", "deit_tiny_patch16_224", "--no-pretrained", "--probe-size", "0", "-o",
     "{out}"], [], 2, ["--probe-size must be at least 1 image"]),
    ("convert-calibration-images-0", ["convert", "deit_tiny_patch16_224", "--no-pretrained", "--calibration-images",
     "0", "-o", "{out}"], [], 2, ["--calibration-images must be at least 1 image"]),
    ("convert-missing-calibration-split", ["convert", "deit_tiny_patch16_224", "--no-pretrained", "--calibration-data",
     "{ckpt}", "--calibration-kind", "imagefolder", "-o", "{out}"], ["ckpt"], 2, ["has no split 'train'", "--split"]),
    ("fidelity-missing-split", ["fidelity", "{ckpt}", "--data", "{ckpt}", "--data-kind", "imagefolder", "--device",
     "cpu"], ["ckpt"], 2, ["has no split 'test'", "--split"]),
    ("finetune-out-is-input", ["finetune", "{ckpt}", "--recipe", str(RECIPE), "-o", "{ckpt}"], ["ckpt"], 2,
     ["is the converted checkpoint"]),
    ("finetune-out-inside-input", ["finetune", "{ckpt}", "--recipe", str(RECIPE), "-o", "{ckpt}/run"], ["ckpt"], 2,
     ["is inside the converted checkpoint"]),
    ("finetune-foreign-folder", ["finetune", "{ckpt}", "--recipe", str(RECIPE), "-o", "{newer}"], ["ckpt", "newer"],
     2, ["is not empty and holds no finetune run", "--force"]),
    # the output rule: never an input, inside one, or a file one reads; its folder exists; a file is not a folder
    ("convert-model-folder-onto-itself", ["convert", "{ckpt}", "-o", "{ckpt}", "--force"], ["ckpt"], 2,
     ["-o", "is the MODEL folder"]),
    ("convert-into-model-folder", ["convert", "{ckpt}", "-o", "{ckpt}/sub", "--force"], ["ckpt"], 2,
     ["is inside the MODEL folder"]),
    ("convert-parent-is-a-file", ["convert", "deit_tiny_patch16_224", "--no-pretrained", "-o", "{textpth}/sub"],
     ["textpth"], 2, ["is a file, not a folder"]),
    ("fidelity-json-onto-config", ["fidelity", "{ckpt}", "--json", "{ckpt}/config.json", "--device", "cpu"], ["ckpt"],
     2, ["--json", "is inside the checkpoint"]),
    ("fidelity-json-onto-weights", ["fidelity", "{ckpt}", "--json", "{ckpt}/model.safetensors", "--device", "cpu"],
     ["ckpt"], 2, ["--json", "is inside the checkpoint"]),
    ("fidelity-plot-onto-data-image", ["fidelity", "{ckpt}", "--data", "{images}", "--plot", "{image}", "--device",
     "cpu"], ["ckpt", "images"], 2, ["--plot", "is inside the --data"]),
    ("fidelity-json-missing-folder", ["fidelity", "{ckpt}", "--json", "/nonexistent/dir/r.json", "--device", "cpu"],
     ["ckpt"], 2, ["folder /nonexistent/dir does not exist"]),
    ("fidelity-guard-refuses-config", ["fidelity", "{unsafe}", "--device", "cpu"], ["unsafe"], 2,
     ["checkpoint_path"]),
    ("bench-json-is-a-folder", [*BENCH, "deit_tiny_patch16_224", "--depth", "1", "--resolutions", "64", "--json",
     "{root}"], ["root"], 2, ["--json", "is a folder"]),
    ("finetune-resume-nothing", ["finetune", "{ckpt}", "--recipe", str(RECIPE), "-o", "{out}", "--resume"], ["ckpt"],
     2, ["--resume:", "holds no training checkpoint"]),
    # sizes, from the shapes alone and before any work (no allocation traceback, no OOM kill)
    ("convert-img-size-below-a-patch", ["convert", "deit_tiny_patch16_224", "--no-pretrained", "--img-size", "8", "-o",
     "{out}"], [], 2, ["takes 8×8 px, less than one 16×16 patch", "--img-size 16"]),
    ("inspect-img-size-below-a-patch", ["inspect", "deit_tiny_patch16_224", "--img-size", "8"], [], 2,
     ["less than one 16×16 patch"]),
    ("convert-img-size-huge", ["convert", "deit_tiny_patch16_224", "--no-pretrained", "--img-size", "100000", "-o",
     "{out}"], [], 2, ["--img-size must be an integer from 1 to 16384, got 100000"]),
    ("bench-resolution-huge", [*BENCH, "deit_tiny_patch16_224", "--resolutions", "224,100000"], [], 2,
     ["--resolutions must be an integer from 1 to 16384, got 100000"]),
    ("convert-contrast-tokens-past-the-grid", ["convert", "deit_tiny_patch16_224", "--no-pretrained",
     "--contrast-tokens", "1000000", "-o", "{out}"], [], 2, ["1000000 is more than the 14×14 patch grid's 196"]),
    ("fidelity-config-img-size-huge", ["fidelity", "{big_img}", "--device", "cpu"], ["big_img"], 2,
     ["model_args.img_size = [60000, 60000]", "from 1 to 16384"]),
    ("fidelity-config-depth-huge", ["fidelity", "{deep}", "--device", "cpu"], ["deep"], 2,
     ["model_args.depth = 100000", "from 1 to 256"]),
    ("convert-plan-contrast-tokens-past-the-grid", ["convert", "deit_tiny_patch16_224", "--no-pretrained", "--plan",
     "{plan_n}", "-o", "{out}"], ["plan_n"], 2, ["pools 1000000 contrast tokens", "196 patches at 224×224 px"]),
    ("convert-plan-other-resolution", ["convert", "deit_tiny_patch16_224", "--no-pretrained", "--plan", "{plan_448}",
     "-o", "{out}"], ["plan_448"], 2, ["was made for 448 px", "takes 224×224 px", "--img-size 448"]),
    ("convert-plan-merges-more-than-exist", ["convert", "deit_tiny_patch16_224", "--no-pretrained", "--plan",
     "{plan_many}", "-o", "{out}"], ["plan_many"], 2, ["merges 1200 tokens in all", "196 patches"]),
    ("finetune-recipe-negative-workers", ["finetune", "{ckpt}", "--recipe", "{recipe_workers}", "-o", "{out}"],
     ["ckpt", "recipe_workers"], 2, ["data.num_workers must be >= 0"]),
    # a vca-patch checkpoint as MODEL: what it is and what to do
    ("convert-a-checkpoint", ["convert", "{ckpt}", "-o", "{out}"], ["ckpt"], 2,
     ["already a vca-patch checkpoint", "target vca", "base model deit_tiny_patch16_224", "vca-patch finetune"]),
    ("inspect-a-checkpoint", ["inspect", "{ckpt}"], ["ckpt"], 2,
     ["already a vca-patch checkpoint", "convert the base model again"]),
]  # fmt: skip


@pytest.mark.parametrize(("args", "inputs", "code", "needles"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gives_one_line_and_changes_nothing(files, tmp_path, monkeypatch, args, inputs, code, needles):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    names = {k: str(v) for k, v in files.items()} | {"out": str(tmp_path / "out")}
    result = run_unchanged([a.format(**names) for a in args], [files[n] for n in inputs])
    line = one_error_line(result, code, *needles)
    assert "or --no-pretrained for random" not in line  # never a hint to pass what was passed
    assert not (tmp_path / "out").exists()
    assert not Path("/nonexistent").exists()  # missing parents are never made


def test_a_conversion_past_the_machines_memory_is_refused_with_the_estimate_and_the_limit(monkeypatch, tmp_path):
    from vca_patch.core import sizes

    monkeypatch.setattr(sizes, "available_memory", lambda device="cpu": (1 << 20, "available memory"))
    result = run_unchanged(["convert", "deit_tiny_patch16_224", "--no-pretrained", "-o", str(tmp_path / "out")], [])
    one_error_line(result, 2, "needs about 29.5 MiB of activations, more than the 1.0 MiB of available memory")
    assert not (tmp_path / "out").exists()


def test_convert_into_the_current_folder_is_refused_and_leaves_no_debris(tmp_path, monkeypatch):
    (tmp_path / "notes.txt").write_text("mine")
    monkeypatch.chdir(tmp_path)
    for output in (".", str(tmp_path), ".."):
        result = run_unchanged(
            ["convert", "deit_tiny_patch16_224", "--no-pretrained", "-o", output, "--force"], [tmp_path]
        )
        one_error_line(result, 2, "current folder", "sub-folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert not [p for p in tmp_path.parent.iterdir() if ".old-" in p.name or ".staging-" in p.name]


def test_staged_directory_resolves_a_relative_name_and_cleans_up_after_a_failure(tmp_path, monkeypatch):
    from vca_patch.core.atomic import UnsafeOutputError, staged_directory

    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "old.pt2").write_text("old")  # a previous export: --force may replace it
    with pytest.raises(UnsafeOutputError), staged_directory(Path("."), overwrite=True):
        pass
    with pytest.raises(OSError, match="disk full"), staged_directory(Path("sub/../sub"), overwrite=True) as stage:
        (stage / "new.txt").write_text("new")
        raise OSError("disk full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sub"]
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["old.pt2"]


def test_convert_force_refuses_a_folder_of_user_files_naming_them_before_any_work(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep?")
    result = run_unchanged(["convert", "deit_tiny_patch16_224", "--no-pretrained", "-o", str(out), "--force"], [out])
    one_error_line(result, 2, "holds what vca-patch did not write: notes.txt", "choose a new folder")
    assert "Attention sites" not in result.output  # refused before the work


def test_an_interrupted_finetune_marks_metrics_and_names_the_resume_step(files, tmp_path, monkeypatch):
    """Ctrl-C inside the training loop: metrics.json says interrupted (not running) and --resume's step."""
    out = tmp_path / "run"

    def interrupted(student, teacher, recipe, output, *args, **kwargs):
        step = Path(output) / "checkpoints" / "step_0000007"
        step.mkdir(parents=True)
        (step / "trainer_state.json").write_text(json.dumps({"global_step": 7}))
        (Path(output) / "metrics.json").write_text(json.dumps({"recipe": recipe.name, "status": "running"}))
        raise KeyboardInterrupt

    monkeypatch.setattr(finetune_module, "run_recipe", interrupted)
    monkeypatch.setattr(classification_task, "check_data_fits", lambda *a: None)
    monkeypatch.setattr(classification_task, "build_dataset", lambda *a, **k: [(torch.zeros(3, 224, 224), 0)])
    result = run_unchanged(["finetune", str(files["ckpt"]), "--recipe", str(RECIPE), "-o", str(out), "--device", "cpu"],
                  [files["ckpt"]])  # fmt: skip
    one_error_line(result, 130, "interrupted", "--resume", "step 7")
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "interrupted" and metrics["resume_step"] == 7
    resumed = runner.invoke(app, ["finetune", str(files["ckpt"]), "--recipe", str(RECIPE), "-o", str(out),
                                  "--resume", "--device", "cpu"])  # fmt: skip
    assert "Resuming from step 7" in resumed.output


def test_a_recipe_whose_images_do_not_fit_the_model_stops_before_training(files, tmp_path):
    from vca_patch.data import DatasetError
    from vca_patch.train import load_recipe
    from vca_patch.train.finetune import check_data_fits

    gray = [(torch.zeros(1, 224, 224), 0)]
    with pytest.raises(DatasetError, match=r"images of shape \(1, 224, 224\), but the model takes \(3, 224, 224\)"):
        check_data_fits(gray, (3, 224, 224), load_recipe(RECIPE))
    check_data_fits([(torch.zeros(3, 224, 224), 0)], (3, 224, 224), load_recipe(RECIPE))


def test_an_error_message_keeps_its_square_brackets(capsys):
    """`pip install -e '.[hf]'` reaches the user whole: messages are text, not rich markup."""
    import typer

    from vca_patch.cli.common import fail

    with pytest.raises(typer.Exit):
        fail("install it with pip install -e '.[hf]'")
    assert "pip install -e '.[hf]'" in capsys.readouterr().err
