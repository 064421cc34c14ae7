"""Commands that wire the packages together rather than belonging to one: `clora config`.

(`clora up`, `clora demo` and `clora simulate` join this module as the loop comes together.)
"""

from __future__ import annotations

import argparse


def add_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("config", parents=[common], help="show or check the effective configuration")
    config_sub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = config_sub.add_parser(
        "show", parents=[common], help="print the effective config (file + environment overrides; keys masked)"
    )
    show.set_defaults(func=config_show)
    env = config_sub.add_parser("env", parents=[common], help="list the environment variables that override fields")
    env.set_defaults(func=config_env)


def config_show(args: argparse.Namespace) -> int:
    from clora.cli import config_from_args
    from clora.config import show_config

    print(show_config(config_from_args(args)))
    return 0


def config_env(args: argparse.Namespace) -> int:
    from clora.config import env_variables

    for var, field in env_variables().items():
        print(f"{var:24} {field}")
    return 0
