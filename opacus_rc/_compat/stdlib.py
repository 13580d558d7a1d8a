"""Private names of the Python standard library (see :mod:`opacus_rc._compat`).

Checked on CPython 3.10 to 3.13; test: ``tests/compat/test_stdlib_contract.py``.
"""

from __future__ import annotations

import argparse

__all__ = ["subcommand_parser"]


def subcommand_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The sub-parser of ``parser`` for sub-command ``command`` (to report an error in its
    usage line).

    Relies on ``ArgumentParser._actions`` and ``argparse._SubParsersAction`` (``argparse``
    offers no public lookup). Test: ``test_stdlib_contract.py::test_subcommand_parser``.

    Raises:
        KeyError: ``parser`` has no sub-command ``command``.
        StopIteration: ``parser`` has no sub-commands.
    """
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]
