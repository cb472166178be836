"""CLI options generated from the registered targets' config fields (built-in, registered, or an installed
plug-in's, found through its entry point when the registry is first read).

A config field with `metadata={"cli": "--flag", "help": "..."}` becomes one `--flag` option of the commands decorated
with `with_target_options`; its default and help are the field's (written once, in the target's config). Commands
then pick the options of the chosen `--to` target with `target_config` and refuse those of other targets."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import typer

import vca_patch.targets  # noqa: F401  (registers the built-in targets)
from vca_patch.core.errors import ConfigError
from vca_patch.targets.base import CONFIG_TYPES, TargetConfig

F = TypeVar("F", bound=Callable[..., Any])
A = TypeVar("A")


@dataclass
class TargetOption:
    """One generated CLI option: the config field `field` of each target in `owners`."""

    field: str
    decls: str  # e.g. "--window" or "--token-magnitude/--no-token-magnitude"
    annotation: Any  # the CLI-side type (a list[int] field is read as "9,16,49")
    default: Any
    helps: dict[str, str]  # target -> its field's help
    is_list: bool

    @property
    def flag(self) -> str:
        return self.decls.split("/")[0]

    @property
    def param(self) -> str:
        return "target_" + self.flag.lstrip("-").replace("-", "_")

    def parameter(self) -> inspect.Parameter:
        helps = list(self.helps.items())
        text = helps[0][1] if len(helps) == 1 else "; ".join(f"{t}: {h}" for t, h in helps)
        owners = "/".join(self.helps)
        option = typer.Option(self.decls, help=f"{owners}: {text}" if len(helps) == 1 else text)
        kind = inspect.Parameter.KEYWORD_ONLY
        return inspect.Parameter(self.param, kind, default=self.default, annotation=Annotated[self.annotation, option])

    def value(self, given: Any) -> Any:
        """The field value for the option's CLI value (a list[int] field parses "9,16,49,49")."""
        if not self.is_list or given is None:
            return given
        try:
            return [int(part) for part in given.split(",")]
        except ValueError:
            raise ConfigError(
                f"{self.flag} {given!r} is not a comma-separated list of integers; use e.g. 9,16,49,49"
            ) from None


def _cli_type(hint: Any) -> tuple[Any, bool]:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if len(args) == 1 and typing.get_origin(args[0]) is list:
        return str | None, True
    return hint, False


def target_options() -> list[TargetOption]:
    """One option per CLI flag over all registered targets (a flag shared by targets must share its default)."""
    options: dict[str, TargetOption] = {}
    for target, config_cls in sorted(CONFIG_TYPES.items()):
        hints = typing.get_type_hints(config_cls)
        for f in dataclasses.fields(config_cls):
            if "cli" not in f.metadata:
                continue
            annotation, is_list = _cli_type(hints[f.name])
            option = options.setdefault(
                f.metadata["cli"], TargetOption(f.name, f.metadata["cli"], annotation, f.default, {}, is_list)
            )
            if (option.field, option.default) != (f.name, f.default):
                raise TypeError(f"{f.metadata['cli']}: {target}'s field differs from {sorted(option.helps)}'")
            option.helps[target] = f.metadata["help"]
    return list(options.values())


def command_parameters(args_cls: type, with_targets: bool = True) -> list[inspect.Parameter]:
    """The typer parameters of dataclass `args_cls`'s fields (`Annotated[type, typer.X]`, their defaults), then (with
    `with_targets`) one keyword-only option per CLI field of every target registered now."""
    hints = typing.get_type_hints(args_cls, include_extras=True)
    kind = inspect.Parameter.KEYWORD_ONLY
    params = [
        inspect.Parameter(f.name, kind, annotation=hints[f.name], default=_default(f))
        for f in dataclasses.fields(args_cls)
    ]
    return params + ([option.parameter() for option in target_options()] if with_targets else [])


class TargetCommand:
    """`func(**options)` with the signature typer reads computed when typer builds the CLI (each `app()` call), not
    at import: a target registered later (`register_target`, a plug-in's entry point) brings its own options."""

    def __init__(self, func: Callable[..., Any], args_cls: type, with_targets: bool = True) -> None:
        self.func, self.args_cls, self.with_targets = func, args_cls, with_targets
        self.__name__, self.__qualname__ = func.__name__, func.__qualname__
        self.__doc__, self.__module__ = func.__doc__, func.__module__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.func(*args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.Signature(command_parameters(self.args_cls, self.with_targets), return_annotation=None)

    @property
    def __annotations__(self) -> dict[str, Any]:  # resolved objects: typing.get_type_hints needs no namespace
        return {p.name: p.annotation for p in command_parameters(self.args_cls, self.with_targets)} | {"return": None}


def typer_command(args_cls: type, *, target_options: bool = True) -> Callable[[Callable[..., Any]], TargetCommand]:
    """Make `func(**options)` a typer command whose options are `args_cls`'s fields and (`target_options`) every
    target's options."""
    return lambda func: TargetCommand(func, args_cls, target_options)


def _default(f: dataclasses.Field[Any]) -> Any:
    return inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default


def split_options(args_cls: type[A], options: dict[str, Any]) -> tuple[A, dict[str, Any]]:
    """`options` as (an `args_cls`, the target options' values by parameter name)."""
    names = {f.name for f in dataclasses.fields(args_cls)}  # type: ignore[arg-type]
    args = args_cls(**{k: v for k, v in options.items() if k in names})
    return args, {k: v for k, v in options.items() if k not in names}


def target_names(extra: tuple[str, ...] = ()) -> str:
    names = [*sorted(CONFIG_TYPES), *extra]
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]


def refuse_foreign(to: str, given: dict[str, tuple[bool, tuple[str, ...]]]) -> None:
    """Refuse options given (True) that belong to other targets than `to`: {flag: (given, owner targets)}."""
    by_owner: dict[str, list[str]] = {}
    for flag, (changed, owners) in given.items():
        if changed and to not in owners:
            by_owner.setdefault(" or --to ".join(owners), []).append(flag)
    for owner, flags in by_owner.items():
        verb, pronoun = ("is", "it") if len(flags) == 1 else ("are", "them")
        raise ConfigError(f"{', '.join(flags)} {verb} for --to {owner}, not --to {to}; drop {pronoun}")


def refuse_other_targets(to: str, values: dict[str, Any], extra: dict[str, tuple[bool, tuple[str, ...]]]) -> None:
    """Refuse target options (`values`, by parameter name) and `extra` options given for other targets than `to`."""
    options = {o.flag: (values[o.param] != o.default, tuple(o.helps)) for o in target_options()}
    refuse_foreign(to, {**options, **extra})


def target_config(to: str, values: dict[str, Any], **common: Any) -> TargetConfig:
    """The `to` target's config from its options' `values` (by parameter name) and the common fields."""
    config_cls = CONFIG_TYPES.get(to)
    if config_cls is None:
        failed = CONFIG_TYPES.failures.get(to)
        reason = f" (the plug-in {to!r} is installed but did not load: {failed})" if failed else ""
        raise ConfigError(f"--to must be {target_names()}, got {to!r}{reason}")
    refuse_other_targets(to, values, {})
    fields = {o.field: o.value(values[o.param]) for o in target_options() if to in o.helps}
    return config_cls(**fields, **common)
