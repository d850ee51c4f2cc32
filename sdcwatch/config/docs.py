"""The command line and the reference of ``sdcwatch serve``'s settings, generated from the
attribute docstrings of the config dataclasses (the string right after each field): the one source
of ``--help``, the reference table and the example file.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
from pathlib import Path
from typing import Any, Mapping

from sdcwatch.config.loaders import ENV_PREFIX, all_keys, default_of, env_name, flag_name, load_config
from sdcwatch.config.schema import SECTIONS, ServeConfig, hints

__all__ = ["add_serve_arguments", "overrides_from_args", "config_from_args", "field_docs"]

#: Short flags besides the canonical --<section>-<key> ones.
_FLAG_ALIASES: dict[str, tuple[str, ...]] = {
    "bus.bootstrap": ("--bootstrap",),
    "bus.connect_timeout_s": ("--connect-timeout",),
    "detectors.stage": ("--stage",),
    "alerts.alertmanager_url": ("--alertmanager-url",),
    "alerts.webhook_url": ("--webhook-url",),
}


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare ``--config`` and one flag per setting (``--<section>-<key>``, plus short aliases),
    absent from the namespace unless typed. Kafka security settings have none: a password on the
    command line is visible to every user of the machine (``ps``)."""
    parser.add_argument(
        "--config",
        metavar="PATH",
        default=None,
        help=f"TOML configuration file (default: ${ENV_PREFIX}CONFIG if set); see sdcwatch/serve.example.toml",
    )
    docs = field_docs()
    for dotted, kind in all_keys().items():
        if dotted.startswith("bus.security."):
            continue
        names = (flag_name(dotted), *_FLAG_ALIASES.get(dotted, ()))
        help_text = f"{docs.get(dotted, '')} [{env_name(dotted)}; default: {_show(default_of(dotted))}]"
        help_text = help_text.replace("%", "%%")
        if kind is bool:
            how: dict[str, Any] = {"action": argparse.BooleanOptionalAction}
        elif dotted.endswith("url"):
            how = {"metavar": "URL"}
        else:
            seconds = "SECONDS" if dotted.endswith("_s") else "X"
            how = {"metavar": {int: "N", float: seconds, Path: "DIR", tuple: "A,B"}.get(kind, "TEXT")}
        parser.add_argument(*names, dest=dotted, default=argparse.SUPPRESS, help=help_text, **how)
    return parser


def overrides_from_args(ns: argparse.Namespace) -> dict[str, Any]:
    """The settings the user gave as flags, as ``{dotted key: value}`` for :func:`load_config`."""
    keys = all_keys()
    return {k: v for k, v in vars(ns).items() if k in keys and v is not None}


def config_from_args(ns: argparse.Namespace, env: Mapping[str, str] | None = None) -> ServeConfig:
    """:func:`load_config` from a namespace parsed with :func:`add_serve_arguments`."""
    return load_config(getattr(ns, "config", None), env, overrides_from_args(ns))


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == "":
        return "off"
    if isinstance(value, tuple):
        return ",".join(value)
    return str(value)


@functools.lru_cache(maxsize=None)
def _own_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of one class body (the string right after each field), {} without source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    docs: dict[str, str] = {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def field_docs() -> dict[str, str]:
    """Dotted key -> its one-line documentation, for every key: the docstring of its field, written in
    its class or a base (``[detectors]``'s are :class:`~sdcwatch.service.pipeline.PipelineSettings`')."""
    out: dict[str, str] = {}

    def walk(cls: type, prefix: str) -> None:
        for klass in reversed(cls.__mro__):
            out.update({f"{prefix}{name}": doc for name, doc in _own_docs(klass).items()})
        for name, kind in hints(cls).items():
            if dataclasses.is_dataclass(kind):
                walk(kind, f"{prefix}{name}.")

    for section, cls in SECTIONS.items():
        walk(cls, f"{section}.")
    return out
