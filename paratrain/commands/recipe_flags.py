"""A recipe's settings as command-line flags, derived from the recipe (paratrain/recipe.py `recipe_settings`): one
flag per config key a Recipe reads (its keyed fields and the memory tiers), named after the key unless the field
names its flag, typed and with the choices of the config's own annotation, described by the config's own comment
(the text docs/configuration.md shows). A new recipe setting gets its flag with no line here."""

from __future__ import annotations

import argparse
import typing
from typing import Literal, get_origin

from paratrain.capabilities import CAPABILITIES
from paratrain.config import Config, parse_bool
from paratrain.errors import UserError
from paratrain.config_reference import LazyHelp, describe
from paratrain.recipe import Recipe, recipe_settings

SECTION_TITLES = {"memory": "memory tiers (the [memory] section; docs/memory-tiers.md)"}


def _section_class(section: str) -> type:
    return type(getattr(Config(), section))


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def add_recipe_flags(parser: argparse.ArgumentParser, recipe=Recipe, skip: tuple[str, ...] = (),
                     only: tuple[str, ...] | None = None) -> dict:
    """Add a flag for every setting of `recipe` (or those of the config keys in `only`) but the config keys in `skip`
    (dest: the flag's name with underscores; None when not given). Returns the argument group of each section, for
    the caller's own flags."""
    groups: dict = {}
    for key, flag in recipe_settings(recipe).items():
        if key in skip or (only is not None and key not in only):
            continue
        section, name = key.split(".")
        cls = _section_class(section)
        if section not in groups:
            groups[section] = parser.add_argument_group(SECTION_TITLES.get(section, f"[{section}]"))
        annotation = typing.get_type_hints(cls)[name]
        text = LazyHelp(lambda section=section, cls=cls, name=name: describe(section, cls, name))  # (on --help)
        if annotation is bool:
            groups[section].add_argument(flag, dest=_dest(flag), action="store_true", default=None, help=text)
            continue
        if annotation == bool | None:  # unset by default, so the flag says which: --tf32 false
            groups[section].add_argument(flag, dest=_dest(flag), default=None, metavar="true|false", help=text,
                                         type=lambda value, flag=flag: parse_bool(flag, value))
            continue
        # (choices are checked where the setting is, with its own one-line error, not by argparse)
        literal = get_origin(annotation) is Literal
        groups[section].add_argument(flag, dest=_dest(flag), default=None, type=str if literal else annotation,
                                     metavar=name.split("_")[-1].upper(), help=text)
    return groups


def recipe_flag_values(args: argparse.Namespace, recipe=Recipe) -> dict[str, object]:
    """{config key: value} of the recipe flags given."""
    return {key: getattr(args, _dest(flag)) for key, flag in recipe_settings(recipe).items()
            if getattr(args, _dest(flag), None) is not None}


def with_recipe_flags(cfg: Config, args: argparse.Namespace, recipe=Recipe) -> Config:
    """`cfg` with the recipe flags given written over its sections (changed in place and returned)."""
    for key, value in recipe_flag_values(args, recipe).items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


# -- keys of the capabilities' own sections (Capability.section_flags) ------------------------------------------------

def add_section_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """Add the flags the capabilities give `command` ("estimate" | "plan") for keys of their own sections."""
    for cls in CAPABILITIES:
        for f in cls.section_flags:
            if command in f.helps:
                parser.add_argument(f.flag, dest=_dest(f.flag), type=f.type, default=None, help=f.helps[command])


def with_section_flags(cfg: Config, args: argparse.Namespace, command: str) -> Config:
    """`cfg` with the section flags of `command` given written over the capabilities' sections (changed in place and
    returned), each section checked: a one-line UserError naming the flag of a bad key."""
    for cls in CAPABILITIES:
        flags = [f for f in cls.section_flags if command in f.helps]
        if not flags:
            continue
        section = getattr(cfg, cls.name)
        for f in flags:
            if getattr(args, _dest(f.flag)) is not None:
                setattr(section, f.key, getattr(args, _dest(f.flag)))
        why = cls.section_problem(section)
        if why:
            for f in flags:
                why = why.replace(f"{cls.name}.{f.key}", f.flag)
            raise UserError(why)
    return cfg
