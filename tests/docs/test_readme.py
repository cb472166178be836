"""README.md runs as written: its Install and quickstart blocks, offline, from a folder laid out like a fresh clone
after `make demo`.

A command line (or a whole Python block) that ends in `# needs: WHAT` needs what it says (network, the Hub, a
token, a data set) and is skipped, naming it; every other line runs and must exit 0. The demo's outputs are stood
in for: small PNG photos under out/photos/{calibration,evaluation}, and the real DINOv2 weights linked from their
cache (`benchmarks/dinov2_weights`) when cached, else the lines that read them are skipped.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RUN = ("Quickstart: Python", "Quickstart: command line")  # the sections whose code this test runs
MARKED = ("Install",)  # sections whose every line needs something a test has not (the network), and says so
NOT_RUN = {  # the other sections with code, and what runs their commands instead
    "Three measured results": "the measured runs themselves (minutes to hours each): benchmarks/ and examples/",
}
NEEDS = re.compile(r"#\s*needs:\s*(.*\S)\s*$")
DEMO_WEIGHTS = "out/dinov2_small.safetensors"
DEMO_PHOTOS = {"calibration": 11, "evaluation": 10}  # examples/demo_inputs.py's two sets
TIMEOUT_S = 1200  # `plan` at 518 px on one core takes ~6 minutes


@dataclass(frozen=True)
class Block:
    """One fenced code block of the README: its section, language and text."""

    section: str
    language: str
    text: str

    @property
    def commands(self) -> list[str]:
        """The block's commands: lines joined across trailing backslashes, blank and comment-only lines dropped."""
        joined = re.sub(r"\\\n\s*", "", self.text)
        return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def readme_blocks() -> list[Block]:
    """Every ```bash and ```python block of README.md, with the `## ` section it is in."""
    blocks, section = [], ""
    for part in re.split(r"^(## [^\n]*|```(?:bash|python)\n.*?^```)$", README.read_text(), flags=re.M | re.S):
        if part.startswith("## "):
            section = part[3:].strip()
        elif part.startswith("```"):
            language, _, body = part[3:].partition("\n")
            blocks.append(Block(section, language, body.rpartition("```")[0]))
    return blocks


def _blocks(section: str, language: str) -> list[Block]:
    return [block for block in readme_blocks() if block.section == section and block.language == language]


def needs(line: str) -> str | None:
    """What a line says it needs (`# needs: ...` at its end), or None: a line the test runs."""
    match = NEEDS.search(line)
    return match.group(1) if match else None


def _write_photos(folder: Path, count: int) -> None:
    """`count` small RGB PNGs of smooth random colour (stand-ins for the demo's photos)."""
    import torch
    from PIL import Image

    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(count)
    for index in range(count):
        coarse = torch.rand(3, 6, 8, generator=generator)
        image = torch.nn.functional.interpolate(coarse[None], size=(96, 128), mode="bilinear")[0]
        Image.fromarray((image.permute(1, 2, 0) * 255).round().byte().numpy()).save(folder / f"photo{index}.png")


def _real_weights() -> Path | None:
    """The cached real DINOv2 timm weights, or None (not cached and not fetchable in 5 s)."""
    pytest.importorskip("skimage")  # dinov2_weights' photos module imports it
    from dinov2_weights import RealWeightsError, cached_weights

    try:
        return cached_weights(timeout=5)[1]
    except RealWeightsError:
        return None


@pytest.fixture
def demo_clone(tmp_path: Path) -> tuple[Path, bool]:
    """(a folder laid out like the clone after `make demo`, whether it holds the real weights): the repository's
    top-level entries linked in, and a fresh out/ with stand-in photos and the cached weights linked in."""
    for entry in ROOT.iterdir():
        if not entry.name.startswith(".") and entry.name != "out":
            (tmp_path / entry.name).symlink_to(entry)
    for name, count in DEMO_PHOTOS.items():
        _write_photos(tmp_path / "out" / "photos" / name, count)
    weights = _real_weights()
    if weights is not None:
        (tmp_path / DEMO_WEIGHTS).symlink_to(weights)
    return tmp_path, weights is not None


def _env() -> dict[str, str]:
    """Offline, with this interpreter's `python` and `vca-patch` first on PATH."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PATH": path}


def _run(args: list[str], cwd: Path, what: str) -> None:
    run = subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    output = (run.stdout + run.stderr)[-3000:]
    assert run.returncode == 0, f"README line failed (exit {run.returncode}): {what}\n{output}"


def test_every_block_is_in_a_section_the_test_runs_or_says_why_not():
    blocks = readme_blocks()
    sections = {block.section for block in blocks}
    assert set(RUN) | set(MARKED) <= sections, set(RUN) | set(MARKED) - sections  # still there, with code
    assert sections <= set(RUN) | set(MARKED) | set(NOT_RUN), sections - set(RUN) - set(MARKED) - set(NOT_RUN)
    for section in RUN:  # the quickstarts run something: a block marked whole would not be tested
        lines = [line for block in blocks if block.section == section for line in block.commands]
        assert any(needs(line) is None for line in lines), f"{section}: every line is marked `# needs:`"
    unmarked = [line for block in blocks if block.section in MARKED for line in block.commands if not needs(line)]
    assert not unmarked, f"lines no test runs, without `# needs:`: {unmarked}"


def test_the_needs_convention_is_read_from_a_line_end_only():
    assert needs("vca-patch push out/m ORG/m   # needs: a Hub token; ORG: yours") == "a Hub token; ORG: yours"
    assert needs("vca-patch convert m -o out/m   # random weights, not the Hub's") is None
    block = Block("s", "bash", "a \\\n    --b c   # needs: x\n# a comment\n\nd\n")
    assert block.commands == ["a --b c   # needs: x", "d"]  # continuations joined, comment lines dropped


@pytest.mark.e2e
@pytest.mark.parametrize("index", range(len(_blocks("Quickstart: Python", "python"))))
def test_the_python_quickstart_runs_as_written(demo_clone, index):
    clone, _ = demo_clone
    block = _blocks("Quickstart: Python", "python")[index]
    if any(needs(line) for line in block.text.splitlines()):
        pytest.skip(f"the block needs: {'; '.join(filter(None, map(needs, block.text.splitlines())))}")
    script = clone / "out" / "readme_quickstart.py"
    script.write_text(block.text)
    _run([sys.executable, str(script)], clone, "the Python quickstart")
    assert (clone / "out" / "deit_tiny_vca_py" / "model.safetensors").is_file()  # save_pretrained wrote it there


@pytest.mark.e2e
def test_the_command_line_quickstart_runs_as_written(demo_clone):
    """Each line in order (later lines read what earlier ones wrote), from the clone's folder; minutes (`plan`)."""
    clone, has_weights = demo_clone
    skipped, ran = [], []
    for line in (line for block in _blocks("Quickstart: command line", "bash") for line in block.commands):
        reason = needs(line) or (None if has_weights or DEMO_WEIGHTS not in line else "the real weights, not cached")
        if reason:
            skipped.append(f"{line.split('#')[0].strip()} (needs {reason})")
            continue
        _run(["bash", "-e", "-o", "pipefail", "-c", line], clone, line)
        ran.append(line)
        for output in re.findall(r"(?:-o|--output)\s+(\S+)", line):  # each output it names is there
            assert (clone / output).exists(), f"{line}: no {output} written"
    assert ran, f"every line needs something: {'; '.join(skipped)}"
    print(f"ran {len(ran)} lines; skipped: {'; '.join(skipped) or 'none'}")


def test_a_command_line_names_only_files_make_demo_or_the_clone_holds():
    """Every path an unmarked quickstart line reads exists after `make demo`: a file of the clone, out/ (written by
    make demo or an earlier line), or a placeholder marked `# needs:`."""
    written = {"out/dinov2_small.safetensors", "out/photos", "out/photos/calibration", "out/photos/evaluation"}
    for block in _blocks("Quickstart: command line", "bash"):
        for line in block.commands:
            if needs(line):
                continue
            words = shlex.split(line, comments=True)
            written.update(re.findall(r"(?:-o|--output)\s+(\S+)", line))
            for word in words:
                if "/" in word and not word.startswith("-"):
                    assert word in written or (ROOT / word).exists(), f"{line}: {word} is neither written nor marked"
