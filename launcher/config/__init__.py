"""Compose a command's config from conf/ and the schema, identically on every rank, and check it.

Hydra's compose API rather than @hydra.main: under torchrun every rank composes the same config
itself, with no per-rank output directories, no chdir and no `${now:}` per rank. The structured
configs in schema.py type every key; `check()` enforces their declared ranges and choices.
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ValidationError

from launcher.config import schema

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key and the value."""


def _register_schemas() -> None:
    store = ConfigStore.instance()
    for name, node in schema.ROOTS.items():
        store.store(name=f"{name}_schema", node=node)


_register_schemas()


def compose_config(overrides: list[str], config_name: str = "config") -> DictConfig:
    """The resolved, struct-mode config of `conf/<config_name>.yaml` with `overrides`, checked
    against its schema's ranges and choices (ConfigError naming the key otherwise)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="dflash"):
        try:
            cfg = compose(config_name=config_name, overrides=overrides)
        except OverrideParseException as exc:
            raise ConfigError(unreadable_override(overrides, exc.override, exc.message)) from None
        except MissingConfigException as exc:
            if "/" not in (exc.missing_cfg_file or ""):
                raise
            raise ConfigError(missing_option(exc.missing_cfg_file, str(exc))) from None
        except ConfigCompositionException as exc:
            wrong = _validation_error(exc)
            if wrong is None:
                raise
            raise ConfigError(wrong_type(config_name, wrong, str(exc))) from None
    OmegaConf.resolve(cfg)
    OmegaConf.set_struct(cfg, True)
    _one_path_as_list(cfg)
    check(cfg, schema.ROOTS[config_name])
    return cfg


def unreadable_override(overrides: list[str], failed: str, hydra_message: str) -> str:
    """One line for an override hydra's grammar cannot read: which one, why, and the same value
    quoted for hydra. A value the shell split at its spaces (`run.dir=/tmp/a b` unquoted) arrives as
    `key=value` and then bare words; they are joined back into the value shown."""
    words = [failed]
    if failed in overrides:
        at = overrides.index(failed)
        start = next((i for i in range(at, -1, -1) if "=" in overrides[i]), at)
        end = next((i for i in range(start + 1, len(overrides)) if "=" in overrides[i]), len(overrides))
        words = overrides[start:end]
    if "=" not in words[0]:
        return f"hydra cannot read the override {failed!r}: it is not key=value (--help lists the keys)"
    lexer = re.match(r"LexerNoViableAltException: .*\n( *)\^", hydra_message)
    if lexer and 0 <= (column := len(lexer.group(1)) - len("LexerNoViableAltException: ")) < len(failed):
        why = f"{failed[column]!r} (character {column + 1}) is not allowed in an unquoted value"
    elif "=" not in failed:
        why = "it is not key=value"
    else:
        why = hydra_message.splitlines()[0]
    if len(words) > 1:
        why += f"; the words after {words[0]!r} look like the rest of its value, split at its spaces by the shell"
    key, _, value = " ".join(words).partition("=")
    inner = "'" if "'" not in value else '"'
    outer = '"' if inner == "'" else "'"
    return (f"hydra cannot read the override {failed!r}: {why}; quote the value for hydra inside the shell's "
            f"quotes: {outer}{key}={inner}{value}{inner}{outer}")


def _named_in(hydra_message: str) -> str:
    """ " (set in <the group option's file>)" when hydra's message says one (`In 'recipe/x': ...`)."""
    where = re.match(r"In '([^']+/[^']+)':", hydra_message)
    return f" (set in {CONF_DIR / where[1]}.yaml)" if where else ""


def missing_option(missing: str, hydra_message: str) -> str:
    """One line for a group option with no file (`recipe=nope`): the options that exist."""
    group, option = missing.rsplit("/", 1)
    options = sorted(f.stem for f in (CONF_DIR / group).glob("*.yaml"))
    return (f"{group}={option!r}{_named_in(hydra_message)}: there is no {CONF_DIR / group / option}.yaml; "
            f"the {group} options are: {', '.join(options) or 'none'}")


def _validation_error(exc: BaseException) -> ValidationError | None:
    """The omegaconf type error behind a failed composition, if that is what failed."""
    while exc is not None and not isinstance(exc, ValidationError):
        exc = exc.__cause__ or exc.__context__
    return exc


def wrong_type(config_name: str, err: ValidationError, hydra_message: str) -> str:
    """One line for a value of the wrong type, from a group option's file or an override: the key,
    the value, the type the schema declares, where the value was set."""
    node, declared = schema.ROOTS[config_name], None
    for name in err.full_key.split("."):   # the field's declared type; none for a key inside a dict or list value
        fields = {spec.name: spec for spec in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else {}
        spec = fields.get(name)
        node, declared = (spec.default_factory, spec.type) if spec else (None, None)
    optional = re.fullmatch(r"Optional\[(.+)\]", declared or "")
    expected = f"must be of type {optional[1] + ' or null' if optional else declared} " if declared else ""
    override = re.match(r"Error merging override (\S+)", hydra_message)
    where = f" (the override {override[1]})" if override else _named_in(hydra_message)
    return f"{err.full_key}={err.value!r}{where}: {expected}(omegaconf: {str(err.msg).splitlines()[0]})"


def _one_path_as_list(cfg: DictConfig) -> None:
    """Keys typed "a path or a list of paths" hold a list from here on, so every reader (and the
    checkpoint's record of the data) sees one form."""
    for key in schema.PATH_LISTS:
        value = OmegaConf.select(cfg, key)
        if isinstance(value, str):
            OmegaConf.update(cfg, key, [value], merge=False)


def config_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True, sort_keys=True)


def config_hash(cfg: DictConfig) -> str:
    return hashlib.sha256(config_yaml(cfg).encode()).hexdigest()[:16]


def flat_config(cfg: DictConfig) -> dict:
    """The resolved config as {"section.key": value} (a list stays one value): what a checkpoint
    records and the trackers log as parameters."""
    def walk(node: dict, prefix: str):
        for key, value in node.items():
            if isinstance(value, dict):
                yield from walk(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value
    return dict(walk(OmegaConf.to_container(cfg, resolve=True), ""))


def require(cfg: DictConfig, ok: bool, key: str, why: str) -> None:
    """Raise a ConfigError naming `key` and its value unless `ok`."""
    if not ok:
        raise ConfigError(f"{key}={OmegaConf.select(cfg, key)!r}: {why}")


def _violation(value, rules: dict) -> str | None:
    """Why `value` breaks `rules` (knob's ge/gt/le/lt/choices/nonempty), or None. None values pass:
    a field that may be null says so in its type. With both choices and bounds (`auto` or a
    number), a value passes as one of the choices or as a number within the bounds."""
    if value is None:
        return None
    if rules.get("nonempty") and isinstance(value, str) and not value.strip():
        return "must not be empty (from a shell variable that was not set?): give a value, or leave the key out"
    choices = ", ".join(str(c).lower() if isinstance(c, bool) else str(c) for c in rules.get("choices", ()))
    bounds = [("ge", lambda a, b: a >= b, ">="), ("gt", lambda a, b: a > b, ">"),
              ("le", lambda a, b: a <= b, "<="), ("lt", lambda a, b: a < b, "<")]
    bounds = [(name, holds, symbol) for name, holds, symbol in bounds if name in rules]
    if "choices" in rules:
        if value in rules["choices"]:
            return None
        if not bounds:
            return f"must be one of {choices}"
    for name, holds, symbol in bounds:
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and holds(value, rules[name])):
            return f"must be {symbol} {rules[name]}" + (f" or one of {choices}" if choices else "")
    return None


def check(cfg: DictConfig, node_type, prefix: str = "") -> None:
    """Every field of `node_type` (a schema dataclass) present in `cfg` obeys its declared rules."""
    for spec in dataclasses.fields(node_type):
        key = prefix + spec.name
        if OmegaConf.is_missing(cfg, spec.name):
            raise ConfigError(f"{key} is required: {spec.metadata['doc']}")
        value = cfg[spec.name]
        if dataclasses.is_dataclass(spec.default_factory):   # a nested section
            check(value, spec.default_factory, key + ".")
            continue
        rules = {k: v for k, v in spec.metadata.items() if k != "doc"}
        items = list(value) if "each" in rules and value is not None else [value]
        for item in items:
            why = _violation(item, rules.get("each", rules))
            if why:
                shown = OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value
                raise ConfigError(f"{key}={shown!r}: {why}")
