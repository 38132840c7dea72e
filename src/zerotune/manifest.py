"""Small, atomic JSON/YAML writers shared by every stage's outputs."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import yaml


def write(path: Path, obj: dict) -> None:
    """Write JSON via temp file + fsync + rename, so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, default=str)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def write_resolved_recipe(folder: Path, recipe) -> None:
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / "recipe.resolved.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
