"""Typer as the command line uses it: its commands' --help shows no `<bool>` placeholder after a switch
(it takes no value), and shell completion knows the run flags and the model names.

The ~166 run flags are not Typer options (rlslurm/settings/flags.py parses them from the config's
fields), so click's completion knew only the handful a command declares: `RunFlagsCommand` adds every
run flag (a boolean's `--no-` form too) and a choice flag's values. `rlslurm --install-completion`
installs it for bash, zsh or fish.
"""

from __future__ import annotations

import typing
from typing import Any

import typer
from typer._click.shell_completion import CompletionItem
from typer.core import TyperCommand, TyperGroup


def _no_switch_placeholder(params: list[Any]) -> list[Any]:
    for p in params:
        if getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""  # Typer shows a type (`<bool>`) where a metavar is unset
    return params


class Command(TyperCommand):
    def get_params(self, ctx: Any) -> list[Any]:
        return _no_switch_placeholder(super().get_params(ctx))


class Group(TyperGroup):
    def get_params(self, ctx: Any) -> list[Any]:
        return _no_switch_placeholder(super().get_params(ctx))


def model_names(incomplete: str) -> list[str]:
    """`--model`'s completion: the shipped model configs (`rlslurm models`)."""
    from rlslurm.settings.model_config import available_models

    return [n for n in available_models() if n.startswith(incomplete)]


def run_flag_completions(previous: str | None, incomplete: str) -> list[tuple[str, str]]:
    """(completion, help) for the word being typed: a run flag, or the value of the choice flag before it."""
    from rlslurm.settings.flags import FIELDS, _kind, flag_help, flag_name

    if incomplete.startswith("-"):
        out = []
        for h in flag_help():
            out.append((h.flag, h.description))
            if _kind(FIELDS[h.field][1]) == "bool":
                out.append(("--no-" + h.flag[2:], h.description))
        return [(f, d) for f, d in out if f.startswith(incomplete)]
    if previous and previous.startswith("--"):
        name = previous[2:].replace("-", "_")
        if name in FIELDS:
            args = [a for a in typing.get_args(FIELDS[name][1]) if a is not type(None)]
            literal = FIELDS[name][1] if typing.get_origin(FIELDS[name][1]) is typing.Literal else \
                next((a for a in args if typing.get_origin(a) is typing.Literal), None)
            if literal is not None:
                return [(str(v), flag_name(name)) for v in typing.get_args(literal) if str(v).startswith(incomplete)]
    return []


class RunFlagsCommand(Command):
    """`submit`, `render`, `run`: every run flag is a completion, though none is a Typer option."""

    def shell_complete(self, ctx: Any, incomplete: str) -> list[CompletionItem]:
        items = super().shell_complete(ctx, incomplete)
        known = {i.value for i in items}
        previous = ctx.args[-1] if ctx.args else None
        items += [CompletionItem(v, help=h) for v, h in run_flag_completions(previous, incomplete) if v not in known]
        return items


class App(typer.Typer):
    """typer.Typer whose commands are `Command`s unless one names its class."""

    def command(self, name: str | None = None, *, cls: type[TyperCommand] | None = None, **kw: Any) -> Any:
        return super().command(name, cls=cls or Command, **kw)
