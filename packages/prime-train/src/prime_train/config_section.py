"""The base of every config section, and the checks several sections share."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """One TOML table: unknown keys are errors, and values are checked when assigned too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def check_folder_name(v: str) -> str:
    """`v` if it can name a folder (letters, digits, '.', '_', '-'; not first '.', '_' or
    '-'); ValueError otherwise."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", v):
        raise ValueError("use letters, digits, '.', '_' or '-' (it names a folder)")
    return v
