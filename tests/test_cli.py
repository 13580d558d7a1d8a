"""The ``opacus-rc`` console script (opacus_rc.cli)."""

from __future__ import annotations

import argparse
import configparser
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import opacus_rc_cli
from opacus_rc.accountants.analysis.envelope import ENVELOPES
from opacus_rc.accountants.analysis.threat_models import THREAT_MODELS
from opacus_rc.cli import EXAMPLES, arg_parser, main
from opacus_rc.version import __version__

ROOT = Path(__file__).resolve().parents[1]


def _row(out: str, label: str) -> list[str]:
    for line in out.splitlines():
        if line.strip().startswith(label + "  "):  # a table row, not the title
            return line.split()[len(label.split()) :]
    raise AssertionError(f"no row {label!r} in:\n{out}")


def test_epsilon_prints_exact_and_randomized_side_by_side(capsys: pytest.CaptureFixture) -> None:
    argv = "epsilon --noise-multiplier 1.0 --sample-rate 0.01 --steps 1000 --delta 1e-5"
    assert main([*argv.split(), "--sketch-dim", "32"]) == 0
    out = capsys.readouterr().out
    assert "exact clipping" in out and "k = 32" in out
    exact, rc = (float(v) for v in _row(out, "epsilon (upper)"))
    # docs/privacy/reference_numbers.md#reference-epsilon: Opacus' PRV accountant gives 1.8384; k =
    # 32 hidden is 2.140 + eps_error
    assert exact == pytest.approx(1.8384, abs=2e-3)
    assert rc == pytest.approx(2.150, abs=0.02)
    remove = [float(v) for v in _row(out, "remove")]
    add = [float(v) for v in _row(out, "add")]
    assert all(a < r for a, r in zip(add, remove))


def test_noise_multiplier_prints_sigmas_and_ratio(capsys: pytest.CaptureFixture) -> None:
    argv = ["noise-multiplier", "--target-epsilon", "3", "-q", "0.01", "--steps", "100", "-k", "32"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    exact, rc = (float(v) for v in _row(out, "noise multiplier"))
    # docs/privacy/reference_numbers.md#reference-sigma (T = 100, target 3): 0.6496 exact, 0.7107
    # for k = 32 hidden
    assert exact == pytest.approx(0.6496, rel=0.01)
    assert rc == pytest.approx(0.7107, rel=0.01)
    assert float(_row(out, "ratio to exact")[1]) == pytest.approx(rc / exact, abs=1e-3)


def test_heavy_tails_are_reported_out_of_range(capsys: pytest.CaptureFixture) -> None:
    assert main(["epsilon", "-s", "0.5", "-q", "0.01", "--steps", "1000", "-k", "1"]) == 0
    assert _row(capsys.readouterr().out, "epsilon (upper)")[-3:] == ["out", "of", "range"]


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        ("epsilon -s 0.005 -q 0.01 --steps 10", r"noise_multiplier must be >= 0.01 \(or 0"),
        ("epsilon -s 1 -q 1.5 --steps 10", r"sample_rate must be in \(0, 1\]"),
        ("epsilon -s 1 -q 0.01 --steps 10 --delta 1", r"delta must be in \(0, 1\)"),
        ("epsilon -s 1 -q 0.01 --steps -5", "--steps must be >= 0"),
    ],
)
def test_bad_values_exit_with_status_2(
    argv: str, match: str, capsys: pytest.CaptureFixture
) -> None:
    assert main(argv.split()) == 2
    err = capsys.readouterr().err
    assert err.startswith("opacus-rc: error:")
    assert re.search(match, err)


@pytest.mark.parametrize(
    "argv",
    [
        "epsilon -q 0.01 --steps 10",  # no noise multiplier
        "epsilon -s 1 -q 0.01",  # neither steps nor epochs
        "epsilon -s 1 -q 0.01 --steps 10 --epochs 2",  # both
        "epsilon -s 1 -q 0.01 --steps 10 -k 0",  # k < 1
        "noise-multiplier -e -1 -q 0.01 --steps 10",  # target epsilon <= 0
        "frobnicate",
    ],
)
def test_malformed_command_lines_exit_with_status_2(argv: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv.split())
    assert exc.value.code == 2


def test_help_documents_every_flag() -> None:
    parser = arg_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == {"epsilon", "noise-multiplier"}
    for name, p in sub.choices.items():
        text = p.format_help()
        for action in p._actions:
            if action.option_strings and action.dest != "help":
                assert action.help and len(action.help) > 15, (name, action.dest)
                assert action.option_strings[0] in text
    eps_help = sub.choices["epsilon"].format_help()
    assert "noise standard deviation" in eps_help and "(0, 1]" in eps_help


def test_envelope_help_names_every_envelope() -> None:
    """Every envelope the accountant accepts is explained in --help (the help once omitted
    'schur')."""
    parser = arg_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for p in sub.choices.values():
        action = next(a for a in p._actions if a.dest == "envelope")
        for name in ENVELOPES:
            assert f"'{name}'" in action.help, name


def test_version_flag_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"opacus-rc {__version__}"


def test_console_script_is_declared() -> None:
    """setup.cfg declares ``opacus-rc`` as the launcher's ``main`` (outside the package, so
    ``--help`` needs no import of it), and that is a callable."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg", encoding="utf-8")
    scripts = dict(
        line.replace(" ", "").split("=", 1)
        for line in config["options.entry_points"]["console_scripts"].strip().splitlines()
    )
    assert scripts["opacus-rc"] == "opacus_rc_cli:main"
    assert "opacus_rc_cli" in config["options"]["py_modules"].split()
    module, _, name = scripts["opacus-rc"].partition(":")
    assert callable(getattr(importlib.import_module(module), name))


def test_launcher_choices_are_the_registries() -> None:
    """The launcher lists the envelope and threat-model names without importing the
    registries; they must stay the registries' names, in order."""
    assert tuple(ENVELOPES) == opacus_rc_cli.ENVELOPE_NAMES
    assert tuple(THREAT_MODELS) == opacus_rc_cli.THREAT_MODEL_NAMES


def test_help_and_version_import_neither_torch_nor_the_library() -> None:
    """Issue 20 item 12: ``opacus-rc --help`` took ~7 s, all of it importing opacus_rc (whose
    import registers the accountant in Opacus, which imports PyTorch). The launcher answers
    ``--help``, ``--version`` and an invalid command line from the standard library: after
    them, no module of torch, opacus, scipy or opacus_rc is loaded (a fresh interpreter)."""
    probe = (
        "import sys, opacus_rc_cli\n"
        "for argv in (['--help'], ['epsilon', '--help'], ['--version'], ['frobnicate']):\n"
        "    try:\n"
        "        opacus_rc_cli.main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = {'torch', 'opacus', 'scipy', 'opacus_rc', 'prv_accountant'}\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & heavy))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert f"opacus-rc {__version__}" in done.stdout


def test_a_missing_option_is_named_with_a_complete_command(
    capsys: pytest.CaptureFixture,
) -> None:
    """The README's `opacus-rc noise-multiplier --target-epsilon 3 ...` without the rest:
    every missing option is named at once, with a command that works (issue 14 item 11)."""
    with pytest.raises(SystemExit) as exc:
        main(["noise-multiplier", "--target-epsilon", "3"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--sample-rate" in err and "--steps" in err and "--epochs" in err
    assert EXAMPLES["noise-multiplier"] in err
    with pytest.raises(SystemExit):
        main(["epsilon", "--sample-rate", "0.01", "--epochs", "1"])
    err = capsys.readouterr().err
    assert "missing --noise-multiplier" in err and EXAMPLES["epsilon"] in err


def test_the_example_commands_run(capsys: pytest.CaptureFixture) -> None:
    """Both example commands work as printed; docs/privacy/reference_numbers.md#reference-sigma
    (T = 1000, target 3): sigma 0.8136
    for exact clipping and 0.8775 for k = 32, hidden (the search targets the upper bound:
    within 2%)."""
    assert main(EXAMPLES["noise-multiplier"].split()[1:]) == 0
    out = capsys.readouterr().out
    sigmas = [float(v) for v in _row(out, "noise multiplier")]
    assert len(sigmas) == 4
    assert sigmas[0] == pytest.approx(0.8136, rel=0.02)
    assert sigmas[2] == pytest.approx(0.8775, rel=0.02)
    assert main(EXAMPLES["epsilon"].split()[1:]) == 0


def test_a_numerical_limit_is_reported_as_such(capsys: pytest.CaptureFixture) -> None:
    """A composition beyond the numerical limits is not "out of range" (which is a privacy
    answer): the cell says "numerical limit" and a note says which knob helps."""
    argv = "epsilon -s 3 -q 0.01 --steps 1000000 --delta 1e-6 --eps-error 1e-5 -k 32"
    assert main(argv.split()) == 0
    out = capsys.readouterr().out
    assert _row(out, "epsilon (upper)") == ["numerical", "limit", "numerical", "limit"]
    assert "increase eps_error" in out


def test_an_install_without_the_launcher_says_to_reinstall() -> None:
    """An editable install made before ``opacus_rc_cli`` existed maps only the package: then
    ``import opacus_rc.cli`` (``python -m opacus_rc.cli``, an old ``opacus-rc`` script) must
    say to reinstall instead of a bare ``No module named 'opacus_rc_cli'``."""
    probe = (
        "import sys\n"
        "sys.modules['opacus_rc_cli'] = None  # not importable, as in such an install\n"
        "try:\n"
        "    import opacus_rc.cli\n"
        "except ModuleNotFoundError as err:\n"
        "    print(err.name, '|', err)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    name, _, message = done.stdout.strip().splitlines()[-1].partition(" | ")
    assert name == "opacus_rc_cli"
    assert "reinstall opacus_rc (in a checkout: pip install -e .)" in message


def _fresh(probe: str) -> str:
    """``probe``'s standard output, run in a fresh interpreter at the repository root."""
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return done.stdout


def test_accountant_and_commands_import_neither_torch_nor_opacus() -> None:
    """Issue 33 item 2: ``import opacus_rc.accountants`` imported torch and Opacus (4.6 s of
    a 6 s ``opacus-rc epsilon``). After the accountant's epsilon and both commands, in a fresh
    interpreter, neither is loaded; the command prints RCAccountant's epsilon."""
    probe = (
        "import sys\n"
        "from opacus_rc.accountants import RCAccountant\n"
        "acc = RCAccountant(sketch_dim=32)\n"
        "acc.history = [(1.0, 0.01, 1000)]\n"
        "print('accountant', acc.get_epsilon(delta=1e-5))\n"
        "import opacus_rc_cli\n"
        "opacus_rc_cli.main('epsilon -s 1.0 -q 0.01 --steps 1000 --delta 1e-5 -k 32'.split())\n"
        "opacus_rc_cli.main('noise-multiplier -e 3 -q 0.01 --steps 100 -k 32'.split())\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'opacus'}))\n"
    )
    out = _fresh(probe)
    assert out.strip().splitlines()[-1] == "[]"
    accountant = float(out.splitlines()[0].split()[1])
    printed = float(_row(out, "epsilon (upper)")[1])
    assert printed == round(accountant, 4)


def test_package_names_resolve_on_use_and_register_rc_for_opacus() -> None:
    """The public names of ``opacus_rc`` are imported on first use; the first Opacus-facing
    name registers "rc" in Opacus' registry (as ``import opacus_rc`` did before), and
    ``import opacus_rc`` registers it at once when torch is already imported."""
    probe = (
        "import sys, opacus_rc\n"
        "print('after import', 'torch' in sys.modules, 'opacus' in sys.modules)\n"
        "assert opacus_rc.RCAccountant.__name__ == 'RCAccountant'\n"
        "print('after RCAccountant', 'opacus' in sys.modules)\n"
        "from opacus_rc import PrivacyEngine\n"
        "from opacus.accountants import IAccountant, registry\n"
        "print('registered', registry._ACCOUNTANTS.get('rc') is opacus_rc.RCAccountant,\n"
        "      isinstance(opacus_rc.RCAccountant(), IAccountant), PrivacyEngine.__module__)\n"
        "import opacus_rc.sketching as sk\n"
        "assert sorted(opacus_rc.__all__) == sorted([*opacus_rc._HOMES, '__version__'])\n"
        "assert all(getattr(opacus_rc, n) is not None for n in opacus_rc.__all__)\n"
        "assert opacus_rc.SketchSpec is sk.SketchSpec and 'SketchSpec' in dir(opacus_rc)\n"
    )
    out = _fresh(probe).splitlines()
    assert out == [
        "after import False False",
        "after RCAccountant False",
        "registered True True opacus_rc.privacy_engine",
    ]
    probe = (
        "import torch, opacus_rc\n"
        "from opacus.accountants import registry\n"
        "print(registry._ACCOUNTANTS.get('rc') is opacus_rc.RCAccountant)\n"
    )
    assert _fresh(probe).split() == ["True"]


@pytest.mark.parametrize(
    "sizes",
    [
        ["--num-batches", "93"],
        ["--dataset-size", "297", "--batch-size", "3"],
        ["--num-batches", "211"],
    ],
    ids=["n93", "n99-from-sizes", "n211"],
)
def test_noise_multiplier_from_public_sizes_is_make_private_with_epsilons(
    sizes: list[str], capsys: pytest.CaptureFixture
) -> None:
    """Issue 33 item 4: ``--sample-rate 1/n --epochs E`` searched at rate 1/n for int(E / q)
    steps, but a Poisson loader over n batches has int(1 / q) batches (n - 1 for n = 93, 99,
    211 in floating point), accounted at 1/(n - 1): the CLI's sigma ended above the target on
    the run's schedule. From the public sizes the command searches at make_private_with_epsilon's
    schedule: the same sigma (oracle: the engine's own search on a loader of n batches)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from opacus_rc import PrivacyEngine

    if sizes[0] == "--num-batches":
        records, batch_size = int(sizes[1]), 1
    else:
        records, batch_size = int(sizes[1]), int(sizes[3])
    assert main(["noise-multiplier", "-e", "4", *sizes, "--epochs", "3", "-k", "32"]) == 0
    out = capsys.readouterr().out
    n = -(-records // batch_size)
    assert f"Poisson rate 1/{n}; accounted as make_private_with_epsilon: {n - 1} steps" in out
    assert f"{3 * (n - 1)} steps" in out.splitlines()[0]
    cli_sigma = float(_row(out, "noise multiplier")[1])

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    data = TensorDataset(torch.randn(records, 4), torch.randint(0, 2, (records,)))
    engine = PrivacyEngine()
    _, optimizer, _, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=batch_size),
        criterion=torch.nn.CrossEntropyLoss(),
        target_epsilon=4.0,
        target_delta=1e-5,
        epochs=3,
        max_grad_norm=1.0,
        clipping="randomized",
        sketch_dim=32,
    )
    assert len(loader) == n - 1  # the schedule the CLI printed
    assert cli_sigma == pytest.approx(optimizer.noise_multiplier, abs=5e-5)


def test_a_bare_sample_rate_says_which_schedule_it_assumes(capsys: pytest.CaptureFixture) -> None:
    """Issue 33 item 4: a bare --sample-rate is accounted as given for int(E / q) steps (Opacus'
    convention), and the output says so and names the options for a run's schedule; its sigma
    is below the one at the run's schedule (1/92 per step), which is why the latter exists."""
    argv = ["noise-multiplier", "-e", "4", "--epochs", "3", "-k", "32"]
    assert main([*argv, "--sample-rate", repr(1 / 93)]) == 0
    out = capsys.readouterr().out
    assert "schedule: every step accounted at the given rate 0.0107527" in out
    assert "int(1 / q) = 92 batches, each accounted at 1/92, for 276 steps" in out
    bare = float(_row(out, "noise multiplier")[1])
    assert main([*argv, "--num-batches", "93"]) == 0
    assert bare < float(_row(capsys.readouterr().out, "noise multiplier")[1])
    with pytest.raises(SystemExit):
        main([*argv, "--sample-rate", "0.01", "--num-batches", "93"])
    assert "give one of --sample-rate or --num-batches" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*argv, "--dataset-size", "93"])
    assert "--dataset-size and --batch-size go together" in capsys.readouterr().err
