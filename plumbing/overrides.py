"""Overrides: a run's config from the command line, as the commands read it. A preset
(config.PRESETS), then a TOML file (`--config RUN.TOML`, model keys under [model]), then
`--key=value` / `--key value` flags (`--model.key=value` for the model's shape), each value
typed from its dataclass field and refused in one line naming the key and what it
expected; an unknown key suggests the closest name. `--help` lists every knob, in
config.py's groups, with its default and its one-line description.

Imports from stacklm: cli (the one-line errors), config (the dataclasses, the presets, the
knobs' choices) and hf_import (the shape of a model --init_from names).
"""

import argparse
import dataclasses
import difflib
import shlex
import tomllib
import types
import typing

from config import CHOICES, PRESETS, StackConfig, TrainConfig
from plumbing import hf_import
from plumbing.cli import ArgumentParser


def _parse_value(text: str, kind, key: str):
    """Turn the text of `--key=value` into the field's type, or say what was expected."""
    if isinstance(kind, types.UnionType):  # `int | None`
        if text.lower() in ("none", "null", ""):
            return None
        kind = next(k for k in typing.get_args(kind) if k is not type(None))
    if kind is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"--{key}={text!r}: expected true or false")
    if kind == tuple[dict, ...]:  # tables: only a TOML file writes them
        if text.strip().lower() in ("", "()", "[]", "none"):
            return ()
        raise ValueError(f"--{key}: set data stages in a TOML file ([[data_stages]] tables with "
                         f"start and data_dir), or use --anneal_data_dir")
    if typing.get_origin(kind) is tuple:
        parts = text.strip("()[] ").split(",")
        return tuple(_parse_value(p.strip(), typing.get_args(kind)[0], key) for p in parts)
    try:
        if kind is int:
            return int(text.replace("_", "").replace(",", ""))
        return kind(text)
    except ValueError:
        raise ValueError(f"--{key}={text!r}: expected {kind.__name__}") from None


def _check_type(value, kind, key: str):
    """A value that arrived typed (from TOML) must already be of the field's type: TOML's
    `eval_tokens = 1e3` is a float and `betas = 0.9` a single number, and neither should
    slip past the conversion the command line gets. An int is accepted for a float."""
    optional = isinstance(kind, types.UnionType)
    if optional:
        if value is None:
            return None
        kind = next(k for k in typing.get_args(kind) if k is not type(None))
    if kind == tuple[dict, ...]:
        ok = isinstance(value, list) and all(isinstance(v, dict) for v in value)
        expected = "[[data_stages]] tables, each with start and data_dir"
    elif typing.get_origin(kind) is tuple:
        ok = isinstance(value, (list, tuple)) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        expected = "a list of numbers, e.g. [0.9, 0.95]"
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        expected = "a number"
    else:
        ok = type(value) is kind
        expected = {int: "an integer", bool: "true or false",
                    str: "a quoted string"}.get(kind, kind.__name__)
        if kind is int and isinstance(value, float) and value.is_integer():
            expected += f" (write {int(value)}, not {value!r}: TOML reads 1e3 as a float)"
    if not ok:
        raise ValueError(f"{key} = {value!r}: expected {expected}")
    return tuple(value) if typing.get_origin(kind) is tuple else value


# Flags of train.py's command line that are not config keys: parse_args reads them, and an
# unknown key is matched against them too (`--presets` means --preset).
COMMAND_LINE_ONLY = ("preset", "config", "debug", "force")


# Flags of the other commands that a user may give train.py: the command that takes them.
OTHER_COMMANDS = {
    "export": "train.py exports nothing: after training, `python export.py OUT_DIR` writes "
              "the newest checkpoint as OUT_DIR/export/ (--format hf: a transformers folder)",
    "source": "train.py reads prepared data: `python prepare.py --source CORPUS --data_dir "
              "DIR` prepares a corpus, then pass --data_dir=DIR",
}


def _known_keys() -> list[str]:
    """Every key an override may set: TrainConfig's fields and model.<StackConfig field>."""
    return [f.name for f in dataclasses.fields(TrainConfig) if f.name != "model"] + \
        [f"model.{f.name}" for f in dataclasses.fields(StackConfig)]


def _unknown_key(key: str, known: list[str]) -> ValueError:
    if key in OTHER_COMMANDS:
        return ValueError(f"unknown config key {key!r}: {OTHER_COMMANDS[key]}")
    close = difflib.get_close_matches(key, known + list(COMMAND_LINE_ONLY), n=1)
    hint = f"; did you mean --{close[0]}?" if close else "; see --help for every knob"
    return ValueError(f"unknown config key {key!r}{hint}")


def _typed(value, kind, key: str):
    """A value from the command line (a string) or TOML (typed), as the field's type."""
    if isinstance(value, str) and kind is not str:
        return _parse_value(value, kind, key)
    return _check_type(value, kind, key)


def apply_overrides(cfg: TrainConfig, overrides: dict[str, typing.Any]) -> TrainConfig:
    """Return a new, validated config with `{"key": value, "model.key": value}` applied.
    Values may be strings (from the CLI) or already typed (from TOML)."""
    train_types, model_types = (typing.get_type_hints(TrainConfig),
                                 typing.get_type_hints(StackConfig))
    known = _known_keys()
    top, model = {}, {}
    for key, value in overrides.items():
        target, types_, name = (model, model_types, key[6:]) if key.startswith("model.") \
            else (top, train_types, key)
        if name not in types_ or name == "model":
            raise _unknown_key(key, known)
        target[name] = _typed(value, types_[name], key)
    new_model = dataclasses.replace(cfg.model, **model)
    return dataclasses.replace(cfg, model=new_model, **top)


def _flatten_toml(table: dict) -> dict:
    flat = {}
    for key, value in table.items():
        if key == "model" and isinstance(value, dict):
            flat.update({f"model.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return flat


def _knob_rows(defaults, prefix: str) -> list[tuple[str | None, str]]:
    """(`--name=default`, description) for each knob of a config, and (None, title) where a
    section opens; the default is quoted as a shell needs it (`--sample_prompt='def '`), so
    each line can be pasted as it reads."""
    rows = []
    for f in dataclasses.fields(defaults):
        if f.name != "model":
            if f.metadata.get("section"):
                rows.append((None, f.metadata["section"]))
            choices = " | ".join(CHOICES.get(f.name, ()))
            description = f.metadata.get("help", "")
            rows.append((f"--{prefix}{f.name}={shlex.quote(str(getattr(defaults, f.name)))}",
                         f"{choices}: {description}" if choices else description))
    return rows


def _help_text(preset: str) -> str:
    """The epilog of --help: the knobs in their groups, one line per knob, `--name=default`
    (the defaults of `preset`) beside its description."""
    run = PRESETS[preset]()
    model_help = {f.name: f for f in dataclasses.fields(run)}["model"].metadata["help"]
    rows = _knob_rows(run, "") + [(None, f"model: {model_help}")] + _knob_rows(run.model,
                                                                                  "model.")
    width = max(len(flag) for flag, _ in rows if flag)
    lines = [f"knobs, with the defaults of the {preset} preset (--preset P --help shows P's):"]
    for flag, text in rows:
        lines.append(f"  {flag:<{width}}  {text}" if flag else f"\n {text}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None, default_preset: str = "stack100m"):
    """CLI -> (TrainConfig, actions). Order of precedence: preset < TOML file < flags."""
    presets = ArgumentParser(add_help=False)
    presets.add_argument("--preset", choices=sorted(PRESETS), default=default_preset)
    shown = presets.parse_known_args(argv)[0].preset  # --help lists this preset's defaults
    parser = ArgumentParser(
        description="Pretrain a Stack-100M-style decoder.", epilog=_help_text(shown),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help=f"starting point (default: {default_preset})")
    parser.add_argument("--config", metavar="RUN.TOML", help="TOML file of overrides")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error, not just its message")
    parser.add_argument("--force", action="store_true",
                        help="start even where the memory estimate exceeds this machine's RAM "
                             "(a CPU run; on a GPU it is a warning)")
    args, rest = parser.parse_known_args(argv)
    cfg = PRESETS[args.preset or default_preset]()
    overrides = {}
    if args.config:
        try:
            with open(args.config, "rb") as f:
                overrides.update(_flatten_toml(tomllib.load(f)))
        except FileNotFoundError:
            raise ValueError(f"--config {args.config}: no such file; give the path of a TOML "
                             f"file whose keys are TrainConfig's (model keys under [model]), "
                             f"see --help") from None
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ValueError(f"--config {args.config}: {e}") from None
    items, known = iter(rest), _known_keys()
    for item in items:  # --key=value or --key value, as argparse reads prepare.py's flags
        key, eq, value = item.removeprefix("--").partition("=")
        if item.startswith("--") and not eq:
            if key.replace("-", "_") not in known:  # the key is the mistake, not its value
                raise _unknown_key(key.replace("-", "_"), known)
            value = next(items, None)
            if value is None or value.startswith("--"):
                raise ValueError(f"{item} has no value: write --{key}=VALUE or --{key} VALUE")
        elif not item.startswith("--"):
            raise ValueError(f"cannot read {item!r}: write overrides as --key=value or "
                             f"--key value")
        overrides[key.replace("-", "_")] = value
    if str(overrides.get("init_from")).lower() not in ("none", ""):
        overrides |= public_model_shape(overrides)
    return apply_overrides(cfg, overrides), args


def public_model_shape(overrides: dict) -> dict:
    """The model knobs of --init_from's config.json (`model.<knob>`: value). A model knob
    the command line or TOML also sets must agree: the weights fix the shape."""
    folder = overrides["init_from"]
    shape = hf_import.model_shape(folder)
    model_types = typing.get_type_hints(StackConfig)
    for key, value in overrides.items():
        name = key.removeprefix("model.")
        if key.startswith("model.") and name in shape:
            given = _typed(value, model_types[name], key)
            if given != shape[name]:
                raise ValueError(f"--{key}={value} disagrees with {folder}/config.json "
                                 f"({name} {shape[name]}): the imported weights fix the "
                                 f"model's shape; drop the flag")
    return {f"model.{name}": value for name, value in shape.items()}

