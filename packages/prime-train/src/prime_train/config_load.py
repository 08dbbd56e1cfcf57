"""Build a Config from its four sources: command line > PRIME_SECTION__KEY env > TOML > defaults.

Every mistake becomes a ConfigError whose message names the key, where it came from and the
fix, so the CLI can print one or two lines and exit 2 instead of a traceback.
"""

from __future__ import annotations

import difflib
import os
import tomllib
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from prime_train.config import SECRET_KEYS, SECTIONS, Config
from prime_train.errors import ConfigError

ENV_PREFIX = "PRIME_"
TOKEN_ENV = "PRIME_TOKEN"

__all__ = ["ConfigError", "describe_fields", "load_config"]


def _suggest(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean `{close[0]}`?" if close else ""


def _check_key(section: str, key: str | None, where: str) -> None:
    if section not in SECTIONS:
        raise ConfigError(
            f"unknown section `{section}` ({where}){_suggest(section, list(SECTIONS))} "
            f"Sections: {', '.join(SECTIONS)}."
        )
    if key is None:
        return
    fields = SECTIONS[section].model_fields
    if key not in fields:
        names = [f"{section}.{k}" for k in fields]
        raise ConfigError(
            f"unknown key `{section}.{key}` ({where}){_suggest(f'{section}.{key}', names)} "
            f"Keys of [{section}]: {', '.join(k for k in fields if (section, k) not in SECRET_KEYS)}."
        )


def _annotation_wants(section: str, key: str, kinds: tuple[type, ...]) -> bool:
    ann = SECTIONS[section].model_fields[key].annotation
    return any(typing.get_origin(a) in kinds or a in kinds for a in (ann, *typing.get_args(ann)))


def _allows_none(section: str, key: str) -> bool:
    ann = SECTIONS[section].model_fields[key].annotation
    return type(None) in typing.get_args(ann)


def _from_string(section: str, key: str, raw: str) -> Any:
    """A command-line or environment value: pydantic coerces strings; lists and tables use
    TOML syntax (`[1, 2]`, `{endpoint_url = "http://..."}`)."""
    if raw.lower() in ("none", "null") and _allows_none(section, key):
        return None
    if _annotation_wants(section, key, (dict,)):
        try:
            return tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(
                f"`{section}.{key}` is not a TOML inline table ({e}); write it as "
                f"'{{name = \"value\", other = 1}}'"
            ) from None
    if _annotation_wants(section, key, (list, tuple)):
        try:
            return tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            return raw
    return raw


def read_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(
            f"config file not found: {path} (pass an existing TOML file, "
            "e.g. --config configs/debug.toml)"
        )
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config {path}: {e}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}; fix the file and rerun") from None


def parse_overrides(args: Sequence[str]) -> list[tuple[str, str]]:
    """`--section.key value` or `--section.key=value` pairs; a bare flag means true."""
    out: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(
                f"unexpected argument `{arg}`; overrides look like --section.key VALUE "
                "(e.g. --train.steps 20), see prime-train --help"
            )
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                value = args[i + 1]
                i += 1
            else:
                value = "true"
        out.append((name, value))
        i += 1
    return out


def _set(tree: dict[str, Any], section: str, key: str, value: Any, origin: dict, where: str):
    if not isinstance(tree.setdefault(section, {}), dict):
        raise ConfigError(f"`{section}` must be a [table] of keys ({where})")
    tree[section][key] = value
    origin[(section, key)] = where


def load_config(
    path: str | Path | None,
    overrides: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Config:
    """Merge defaults, the TOML file, the environment and command-line overrides."""
    env = os.environ if env is None else env
    tree: dict[str, Any] = {}
    origin: dict[tuple[str, str], str] = {}

    if path is not None:
        path = Path(path)
        for section, table in read_toml(path).items():
            where = f"in {path}"
            _check_key(section, None, where)
            if not isinstance(table, dict):
                raise ConfigError(
                    f"`{section}` must be a table like [{section}] ({where}), not a value"
                )
            for key, value in table.items():
                _check_key(section, key, f"{where}, [{section}]")
                _set(tree, section, key, value, origin, where)

    for name, raw in sorted(env.items()):
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        section, _, key = name[len(ENV_PREFIX) :].lower().partition("__")
        where = f"from environment {name}"
        _check_key(section, key, where)
        _set(tree, section, key, _from_string(section, key, raw), origin, where)
    if TOKEN_ENV in env and ("mesh", "token") not in origin:
        _set(tree, "mesh", "token", env[TOKEN_ENV], origin, f"from environment {TOKEN_ENV}")

    for name, raw in parse_overrides(overrides):
        section, _, key = name.partition(".")
        where = f"from --{name}"
        _check_key(section, key, where)
        if (section, key) in SECRET_KEYS:
            raise ConfigError(
                f"--{name} is refused: a secret on the command line is visible to every user "
                f"of this machine; export {TOKEN_ENV}=... instead"
            )
        _set(tree, section, key, _from_string(section, key, raw), origin, where)

    try:
        cfg = Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_explain(e, tree, origin)) from None
    check_combined(cfg, origin, env)
    return cfg


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _nearest(values: list[int], x: int, n: int = 2) -> list[int]:
    return sorted(sorted(values, key=lambda v: (abs(v - x), v))[:n])


def uses_diloco(cfg: Config, env: Mapping[str, str]) -> bool:
    """Whether this config trains with DiLoCo: a mesh coordinator to join, or the local
    launcher's nodes (several nodes, or several ranks outside torchrun), which join one."""
    if cfg.mesh.coordinator is not None or cfg.launch.local_nodes > 1:
        return True
    return cfg.launch.ranks_per_node > 1 and "LOCAL_RANK" not in env


def check_combined(
    cfg: Config,
    origin: Mapping[tuple[str, str], str] | None = None,
    env: Mapping[str, str] | None = None,
) -> None:
    """Settings valid one by one but not together: a ConfigError naming the key, where it came
    from and the values that would work."""
    origin = origin or {}
    env = os.environ if env is None else env

    def where(section: str, key: str) -> str:
        return origin.get((section, key), "default")

    t = cfg.train
    if t.micro_batch_size is not None and t.batch_size % t.micro_batch_size:
        ok = _divisors(t.batch_size)
        raise ConfigError(
            f"`train.micro_batch_size` = {t.micro_batch_size} ({where('train', 'micro_batch_size')}) "
            f"does not divide `train.batch_size` = {t.batch_size} ({where('train', 'batch_size')}); "
            f"use a divisor such as {' or '.join(map(str, _nearest(ok, t.micro_batch_size)))} "
            "(or leave it unset: the whole batch at once)"
        )
    frags = cfg.diloco.fragments
    if frags > 1:
        from prime_train.model import PRESETS  # (the model module is heavy: only when used)

        layers = cfg.model.n_layers or PRESETS[cfg.model.preset].n_layers
        if frags > layers:
            raise ConfigError(
                f"`diloco.fragments` = {frags} ({where('diloco', 'fragments')}) is more than "
                f"the model's {layers} layers: use at most {layers} (each fragment holds layers)"
            )
    h, every = cfg.diloco.inner_steps, cfg.ckpt.every
    if every and every % h and uses_diloco(cfg, env):
        below, above = (every // h) * h, (every // h + 1) * h
        near = " or ".join(str(v) for v in (below, above) if v > 0)
        raise ConfigError(
            f"`ckpt.every` = {every} ({where('ckpt', 'every')}) is not a multiple of "
            f"`diloco.inner_steps` = {h} ({where('diloco', 'inner_steps')}): a DiLoCo node "
            f"checkpoints only at outer steps; use ckpt.every = {near} (or 0: only when stopping)"
        )


def _explain(e: ValidationError, tree: dict, origin: dict) -> str:
    err = e.errors()[0]
    loc = [str(p) for p in err["loc"]]
    section = loc[0] if loc else "?"
    key = loc[1] if len(loc) > 1 else None
    msg = err["msg"].removeprefix("Value error, ")
    if key is None or key not in SECTIONS.get(section, Config).model_fields:
        where = next((w for (s, _), w in origin.items() if s == section), "")
        return f"invalid [{section}] settings ({where}): {msg}"
    field = SECTIONS[section].model_fields[key]
    hidden = (section, key) in SECRET_KEYS or (section, key) == ("ckpt", "remote_options")
    shown = "<hidden>" if hidden else repr(tree[section].get(key))
    more = (
        f" ({len(e.errors()) - 1} more error(s) after fixing this)" if len(e.errors()) > 1 else ""
    )
    return (
        f"`{section}.{key}` = {shown} ({origin.get((section, key), 'default')}) is invalid: "
        f"{msg}.{more}\n  Fix: {section}.{key} is {field.description}; "
        f"default {field.default!r}. See prime-train --help."
    )


def describe_fields() -> str:
    """The field reference printed by `prime-train --help`."""
    lines = []
    for section, cls in SECTIONS.items():
        lines.append(f"[{section}]")
        for key, field in cls.model_fields.items():
            default = field.default
            if isinstance(default, Path):
                default = str(default)
            lines.append(f"  --{section}.{key} (default {default!r}): {field.description}")
    return "\n".join(lines)
