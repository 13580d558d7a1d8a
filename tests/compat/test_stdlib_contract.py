"""Contract test of :mod:`opacus_rc._compat.stdlib` on the running Python."""

from __future__ import annotations

import argparse

import pytest

from opacus_rc._compat.stdlib import subcommand_parser


def test_subcommand_parser() -> None:
    parser = argparse.ArgumentParser(prog="p")
    subs = parser.add_subparsers(dest="command")
    eps = subs.add_parser("epsilon")
    noise = subs.add_parser("noise")
    assert subcommand_parser(parser, "epsilon") is eps
    assert subcommand_parser(parser, "noise") is noise
    with pytest.raises(KeyError):
        subcommand_parser(parser, "other")
    with pytest.raises(StopIteration):
        subcommand_parser(argparse.ArgumentParser(), "epsilon")
