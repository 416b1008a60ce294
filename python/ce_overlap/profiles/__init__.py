"""Built-in hardware profiles (schema ce_overlap.profile/2, docs/profiles.md), one JSON file each in this folder."""
from __future__ import annotations

import os
from importlib import resources

from ..errors import CeOverlapError


def names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files(__name__).iterdir() if p.name.endswith(".json"))


def read_text(name_or_path: str) -> str:
    """The JSON text of a built-in profile (by name) or of a profile file (by path)."""
    if name_or_path in names():
        return resources.files(__name__).joinpath(f"{name_or_path}.json").read_text()
    if os.path.sep in name_or_path or name_or_path.endswith(".json"):
        try:
            with open(name_or_path, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise CeOverlapError(f"cannot read profile file {name_or_path!r}: {e.strerror}") from None
    raise CeOverlapError(f"unknown profile {name_or_path!r} (built-in: {', '.join(names())}; or a path to a .json file)")


def load(name_or_path: str):
    """A validated _core.Profile."""
    from .. import _core

    return _core.Profile.from_json(read_text(name_or_path))


# The profile "auto" means without a GPU to ask, or for a GPU no built-in profile fits.
DEFAULT = "h100-sxm"

# GPU name (torch.cuda.get_device_name) -> built-in profile, the one table; a fragment matches case-insensitively and
# the first match wins (so "GH200" comes before "H200", "H100 PCIe" before "H100"); None: no built-in profile fits
# that GPU (another memory system or another interconnect than any built-in profile describes).
BUILTIN_BY_GPU = [
    ("GH200", None), ("GB200", None), ("H100 PCIe", "h100-pcie"), ("H100 NVL", None), ("H100", "h100-sxm"),
    ("H200", "h200-sxm"), ("A100-SXM", "a100-sxm"), ("A100", None), ("B200", "b200"),
]


def builtin_for_device(device_name: str, default: str | None = None) -> str | None:
    """The built-in profile for a GPU name such as 'NVIDIA H200', or `default` when none fits."""
    name = device_name.upper()
    for fragment, profile in BUILTIN_BY_GPU:
        if fragment.upper() in name:
            return profile
    return default


def resolve(name: str) -> tuple[str, str]:
    """(profile, how it was chosen) for a PassConfig-style profile setting: a built-in name or a file path is itself;
    "auto" is the built-in profile of this process's GPU, else DEFAULT (no GPU, or none fits it: said in `how`)."""
    if name != "auto":
        return name, "given"
    try:
        import torch

        if not torch.cuda.is_available():
            return DEFAULT, f"auto: no GPU visible, {DEFAULT}"
        gpu = torch.cuda.get_device_name()
    except Exception as e:  # noqa: BLE001 (no driver: as on a CPU machine)
        return DEFAULT, f"auto: no GPU ({type(e).__name__}), {DEFAULT}"
    fitted = builtin_for_device(gpu)
    if fitted is None:
        return DEFAULT, f"auto: no built-in profile fits {gpu!r}, {DEFAULT} (calibrate one: ce-overlap calibrate)"
    return fitted, f"auto: {gpu}"
