"""Install hints that work: vca-patch is installed from a clone, not from PyPI, so a hint names the packages an
extra holds (`pip install 'transformers>=5'`), read from the installed package's metadata, and the extra itself."""

from __future__ import annotations

import re
from importlib import metadata

_EXTRA_MARKER = re.compile(r"""extra\s*==\s*["']([\w-]+)["']""")


def extra_requirements(extra: str) -> list[str]:
    """The requirements of vca-patch's `extra` (e.g. ["transformers>=5"]), [] when the metadata is not at hand."""
    try:
        requires = metadata.requires("vca-patch") or []
    except metadata.PackageNotFoundError:
        return []
    found = []
    for requirement in requires:
        spec, _, marker = requirement.partition(";")
        match = _EXTRA_MARKER.search(marker)
        if match and match.group(1) == extra:
            found.append(spec.strip().replace(" ", ""))
    return found


def install_hint(extra: str) -> str:
    """A command that installs what `extra` adds: "pip install 'transformers>=5' (vca-patch's hf extra: pip install
    -e '.[hf]' in its clone)"."""
    clone = f"vca-patch's {extra} extra: pip install -e '.[{extra}]' in its clone"
    packages = extra_requirements(extra)
    if not packages:
        return f"pip install -e '.[{extra}]' in the vca-patch clone"
    return "pip install " + " ".join(f"'{p}'" for p in packages) + f" ({clone})"
