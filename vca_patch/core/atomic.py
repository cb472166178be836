"""Atomic file and folder writes: readers see the old content or the new, never half of it; and the checks that
keep an output from landing on what a user would lose (an input, the current or home folder, a Hub cache, a folder
of the user's files, what a symlink points to).

--force (`overwrite`) replaces a folder only when it is empty or holds a vca-patch output and nothing else: the files
of a checkpoint (recognised by its config.json) or of a LLaVA-SP folder, export files (.pt2, .onnx) and plan files."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
import threading
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path


class OutputExistsError(FileExistsError):
    """The output folder exists and is not empty, and overwriting was not asked for."""


class UnsafeOutputError(ValueError):
    """The output would replace or write into something the user keeps: an input, the current or home folder, a Hub
    cache, a folder of the user's files, what a symlink points to, a device or FIFO."""


# What vca-patch writes into a folder it owns (mirrors checkpoint.folder's CONFIG_NAME, CARD_NAME and FORMS, and
# targets.llava_sp.io's files: core sits below both; tests/cli/test_force_safety.py checks they agree).
CHECKPOINT_NAMES = frozenset({"config.json", "README.md", "model.safetensors", "delta.safetensors"})
SPATIAL_TOKENS_NAMES = frozenset({"spatial_tokens.json", "spatial_tokens.safetensors", "vision_patch.safetensors"})
TRANSFORMERS_NAMES = frozenset({  # a LLaVA-SP folder also holds the LLaVA's and its processor's save_pretrained
    "generation_config.json", "model.safetensors.index.json", "preprocessor_config.json", "processor_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.json", "chat_template.jinja",
    "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
})  # fmt: skip
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
EXPORT_SUFFIXES = (".pt2", ".onnx")  # `vca-patch export` writes one self-contained file
SPATIAL_TOKENS_FORMAT = "llava-sp"  # targets.llava_sp's SpatialTokensConfig.format, in spatial_tokens.json
PLAN_FORMAT = "vca-patch-plan"  # planner.plan_file's FORMAT: a plan file is recognised by its content
_MARKER_LIMIT = 64 << 20  # a marker file larger than this is not read (and so not recognised)
_SHOWN = 4  # entries named in a refusal before "and N more"


def file_kind(path: Path | str) -> str | None:
    """What `path` is, in words ("a file", "a folder", "a FIFO", ...; a symlink is not followed); None if absent."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    kinds = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"), (stat.S_ISREG, "a file"),
             (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))  # fmt: skip
    return next((words for test, words in kinds if test(mode)), "a special file")


def physical(path: Path | str) -> Path:
    """`path` made absolute as the file system resolves it: its folder's links and ".." followed in order (so
    "link/../out" is beside the link's target, not beside the link), the last component kept as given (a link
    stays the link)."""
    path = Path(path)
    if path.name in ("", ".", ".."):  # "a/.." names no entry of its own: the folder it resolves to
        return Path(os.path.realpath(path))
    return Path(os.path.realpath(path.parent)) / path.name


def real_path(path: Path | str) -> Path:
    """`path` absolute with every link and ".." resolved (what it is on disk), for comparing paths."""
    return Path(os.path.realpath(os.path.abspath(path)))


def _holds_cwd(path: Path) -> bool:
    cwd = Path.cwd().resolve()
    return path == cwd or path in cwd.parents


def hub_caches() -> list[Path]:
    """The Hugging Face cache folders, resolved: HF_HUB_CACHE, HF_HOME (default ~/.cache/huggingface) and the older
    names, as set now and as huggingface_hub read them when imported. Models given by Hub name live here."""
    env = os.environ
    xdg = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    found = [env.get(name) for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE", "HF_HOME")]
    found += [os.path.join(xdg, "huggingface"), os.path.join(os.path.expanduser("~"), ".cache", "huggingface")]
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        found += [getattr(constants, "HF_HUB_CACHE", None), getattr(constants, "HF_HOME", None)]
    caches = {real_path(os.path.expanduser(p)) for p in found if p}
    return sorted(caches, key=lambda p: -len(p.parts))  # innermost first


def _cache_relation(real: Path) -> str | None:
    """How resolved folder `real` stands to a Hugging Face cache ("is the ... cache X", "is inside ...", "holds
    ..."), the closest relation first; None if it stands in none."""
    caches = hub_caches()
    relations = (("is", lambda c: real == c), ("is inside", lambda c: c in real.parents),
                 ("holds", lambda c: real in c.parents))  # fmt: skip
    for words, test in relations:
        cache = next((c for c in caches if test(c)), None)
        if cache is not None:
            return f"{words} the Hugging Face cache {cache}"
    return None


def _home() -> Path | None:
    try:
        return real_path(Path.home())
    except (RuntimeError, KeyError):  # no HOME and no passwd entry
        return None


def protected_reason(path: Path | str) -> str | None:
    """Why folder `path` may never be replaced as a whole (None if it may): the current folder or one holding it,
    the home folder or one holding it, a Hugging Face cache (or inside or holding one), a filesystem root."""
    real = real_path(path)
    if _holds_cwd(real):
        what = "is the current folder" if real == Path.cwd().resolve() else "is the current folder or holds it"
        return f"{what}; it is replaced as a whole, so pass a new sub-folder (e.g. -o ./converted)"
    home = _home()
    if home is not None and (real == home or real in home.parents):
        what = "is your home folder" if real == home else f"holds your home folder {home}"
        return f"{what}; it is replaced as a whole, so pass a new sub-folder (e.g. -o ~/converted)"
    cache = _cache_relation(real)
    if cache is not None:
        return f"{cache} (the models and datasets downloaded from the Hub); choose a folder outside it"
    if real == Path(real.anchor) or os.path.ismount(real):
        return "is a filesystem root (a mount point); pass a new sub-folder in it"
    return None


def _json_object(path: Path) -> dict | None:
    """The JSON object in regular file `path` (not a link), or None: absent, too large, unreadable, not an object."""
    try:
        if file_kind(path) != "a file" or path.stat().st_size > _MARKER_LIMIT:
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _owned_names(folder: Path) -> Callable[[str], bool]:
    """Which names in `folder` vca-patch writes: a checkpoint's when its config.json is a vca-patch config, a
    LLaVA-SP folder's (with the LLaVA's own files) when it has spatial_tokens.json; none otherwise."""
    config = _json_object(folder / "config.json") or {}
    if {"format_version", "adapter"} <= config.keys():
        return CHECKPOINT_NAMES.__contains__
    spatial = _json_object(folder / "spatial_tokens.json") or {}
    if spatial.get("format") == SPATIAL_TOKENS_FORMAT:
        names = CHECKPOINT_NAMES | SPATIAL_TOKENS_NAMES | TRANSFORMERS_NAMES
        return lambda name: name in names or _SHARD.fullmatch(name) is not None
    return lambda name: False


def unowned_entries(folder: Path | str) -> list[str]:
    """The entries of `folder` that are not a vca-patch output (sorted; sub-folders end in "/"): anything but the
    files of a checkpoint (recognised by its config.json), of a LLaVA-SP folder, export files and plan files.
    Links and sub-folders are never vca-patch's (it writes plain files only)."""
    folder = Path(folder)
    owned = _owned_names(folder)
    foreign = []
    for entry in sorted(folder.iterdir()):
        kind = file_kind(entry)
        ours = kind == "a file" and (
            owned(entry.name)
            or entry.name.endswith(EXPORT_SUFFIXES)
            or (entry.suffix == ".json" and (_json_object(entry) or {}).get("format") == PLAN_FORMAT)
        )
        if not ours:
            foreign.append(entry.name + ("/" if kind == "a folder" else ""))
    return foreign


def shown(names: list[str], limit: int = _SHOWN) -> str:
    """`names` for one line: the first `limit`, then "and N more"."""
    more = len(names) - limit
    return ", ".join(names[:limit]) + (f" and {more} more" if more > 0 else "")


def check_output_dir(path: Path | str, *, overwrite: bool) -> None:
    """Refuse, before any work, a folder that replacing as a whole (`staged_directory`) would lose something by.

    Refused always: a symlink (its target is never replaced), a file or device where the folder would be, the
    current folder, the home folder, a Hugging Face cache, a filesystem root or one holding them
    (`protected_reason`), and a non-empty folder holding anything but a vca-patch output (`unowned_entries`):
    --force replaces what vca-patch wrote, never a user's files. Without `overwrite`, any non-empty folder."""
    given = Path(path)
    path = physical(given)  # as staged_directory names it: "a/.." has no name of its own
    kind = file_kind(path)
    if kind == "a symbolic link":
        raise UnsafeOutputError(f"output {given} is a symbolic link to {os.path.realpath(path)}; it is never followed "
                                "to replace what it points to: name a real folder")  # fmt: skip
    if kind not in (None, "a folder"):
        raise OutputExistsError(f"{given} exists and is {kind}, not a folder; choose a folder")
    reason = protected_reason(path)
    if reason is not None:
        raise UnsafeOutputError(f"output {given} {reason}")
    try:
        filled = kind == "a folder" and any(path.iterdir())
    except OSError as exc:  # an unreadable folder: what is in it cannot be known, so it is not replaced
        raise UnsafeOutputError(f"output {given} cannot be read ({exc.strerror}); choose another folder") from None
    if filled:
        _check_replaceable(given, path, overwrite=overwrite)


def _check_replaceable(given: Path, path: Path, *, overwrite: bool) -> None:
    """A non-empty folder: replaced only with `overwrite`, and only when it holds nothing but a vca-patch output."""
    foreign = unowned_entries(path)
    if foreign:
        error = UnsafeOutputError if overwrite else OutputExistsError
        raise error(f"output {given} is not empty and holds what vca-patch did not write: {shown(foreign)}; "
                    "--force replaces only an empty folder or a vca-patch output, so choose a new folder")  # fmt: skip
    if not overwrite:
        raise OutputExistsError(f"{given} is not empty (it holds a vca-patch output); choose another folder or "
                                "pass --force (in Python: overwrite=True) to replace it")  # fmt: skip


def foreign_entries(path: Path, owned: Collection[str]) -> list[str]:
    """The names in folder `path` that are not in `owned` (sorted; sub-folders end in "/"); [] if it is absent."""
    path = Path(path)
    if not path.is_dir():
        return []
    return sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir() if p.name not in owned)


def current_umask() -> int:
    """The process's umask (read from /proc where it can be, without changing it; else set and restored)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def public_mode(path: Path | str, *, folder: bool = False) -> None:
    """Give a temporary file (0600) or folder (0700) the mode a plain open/mkdir would: 0666/0777 less the umask."""
    os.chmod(path, (0o777 if folder else 0o666) & ~current_umask())


def _public_tree(root: Path) -> None:
    """Give `root` and everything under it the modes a plain open/mkdir would (executable files stay executable)."""
    mask = current_umask()
    for entry in [root, *root.rglob("*")]:
        if entry.is_symlink():
            continue
        mode = 0o777 if entry.is_dir() or entry.stat().st_mode & 0o100 else 0o666
        os.chmod(entry, mode & ~mask)


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        public_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def atomic_file(path: Path | str, *, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside `path` to write (by any writer, e.g. matplotlib); on success it replaces
    `path` in one rename, with the mode a plain open would give; on any error it is removed and `path` is kept."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        public_mode(tmp)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold off Ctrl-C, SIGTERM and SIGHUP for the block (they are delivered, and raise, right after it): a cleanup
    that an interrupt would leave half done (a staging folder half removed) runs to its end."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextmanager
def staged_directory(dest: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it replaces `dest` in one rename.

    On any error, Ctrl-C or SIGTERM (any BaseException; the CLI turns SIGTERM into KeyboardInterrupt) the temporary
    folder is removed and `dest` is left as it was; no staging or `.old-` folder is ever left behind (the swap and
    the cleanup run with interrupts held off until they are done). The current folder (or one holding it) is
    refused: it cannot be renamed away safely.
    """
    dest = physical(dest)  # "." or "a/.." have no name of their own; a symlink stays the link
    check_output_dir(dest, overwrite=overwrite)
    if not dest.parent.is_dir():  # missing parents are never made: a typo would scatter folders
        raise UnsafeOutputError(f"cannot write {dest}: folder {dest.parent} does not exist (create it first)")
    stage = Path(tempfile.mkdtemp(prefix=f".{dest.name}.staging-", dir=dest.parent))
    trash: Path | None = None
    try:
        public_mode(stage, folder=True)
        yield stage
        _public_tree(stage)  # writers that stage privately (mkstemp, safetensors): the umask's modes, as open() gives
        with signals_deferred():
            trash = _swap_in(stage, dest)
    finally:
        with signals_deferred():
            shutil.rmtree(stage, ignore_errors=True)
            if trash is not None:
                shutil.rmtree(trash, ignore_errors=True)


def _swap_in(stage: Path, dest: Path) -> Path | None:
    """Rename `stage` to `dest`, the old `dest` moved to a trash folder first (returned, to remove) and put back if
    the rename fails."""
    if not dest.exists():
        os.replace(stage, dest)
        return None
    trash = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
    try:
        os.replace(dest, trash / dest.name)
        os.replace(stage, dest)
    except BaseException:
        if not dest.exists() and (trash / dest.name).exists():
            os.replace(trash / dest.name, dest)  # put the old folder back
        shutil.rmtree(trash, ignore_errors=True)
        raise
    return trash
