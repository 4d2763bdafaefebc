"""The command line's help: plain text (no reStructuredText markup), every command listed with
what it does, examples, and an exit status of 0."""

import pytest

from moe_route.__main__ import main as cli_main


def _help(capsys, *argv):
    with pytest.raises(SystemExit) as exit_info:
        cli_main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("argv", [(), ("info",), ("demo",), ("bench",)], ids=str)
def test_help_is_plain_text(capsys, argv):
    text = _help(capsys, *argv)
    assert "``" not in text and ":func:" not in text and ":mod:" not in text, text
    assert text.startswith(f"usage: python -m moe_route {' '.join(argv)}".rstrip())


def test_top_level_help_lists_commands_and_examples(capsys):
    text = _help(capsys)
    for command in ("info", "demo", "bench"):
        assert f"    {command}  " in text, f"{command} is not listed:\n{text}"
        assert f"python -m moe_route {command}" in text, f"no example of {command}:\n{text}"
    assert "COMMAND --help" in text


def test_demo_help_explains_its_options(capsys):
    text = _help(capsys, "demo")
    assert "--device DEVICE  device to run on" in text
    assert "--seed SEED" in text and "seed of the random case" in text


# ----------------------------------------------------------------------------- bench --sweep
SWEEP_NAMES = ("gemm", "wgrad", "act", "decode", "bwd_decode", "quant")


def test_sweep_names_are_the_bench_sweeps():
    from moe_route.bench import sweeps

    assert tuple(sweeps.SWEEPS) == SWEEP_NAMES


def test_bench_help_lists_the_sweeps(capsys):
    text = _help(capsys, "bench")
    assert "--sweep NAME" in text and "tuning sweeps" in text
    for name in SWEEP_NAMES:
        assert name in text, name
    for option in ("--training", "--store", "--rounds", "--time-limit", "--rep-ms", "--extra",
                   "--candidates", "--pointer", "--near", "--layouts", "--slots"):  # fmt: skip
        assert option in text, option


@pytest.mark.parametrize("name", SWEEP_NAMES)
def test_each_sweep_name_parses_and_lists_what_it_runs(capsys, name):
    """``--list`` runs nothing (no GPU or interpreter needed): the sweep, its configs and its
    shapes."""
    assert cli_main(["bench", "--sweep", name, "--list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"sweep {name}: ")
    shapes = out.split("shapes:\n", 1)[1].splitlines()
    assert shapes and all(" T=" in line and " H=" in line for line in shapes), out


def test_a_bad_sweep_name_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["bench", "--sweep", "gemmm"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --sweep: invalid choice: 'gemmm'" in err
    for name in SWEEP_NAMES:
        assert f"'{name}'" in err, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sweep", "decode", "--pointer"], "--sweep decode does not take --pointer"),
        (["--sweep", "act", "--quick"], "--sweep act does not take --quick"),
        (["--sweep", "gemm", "--stages", "maps"], "--sweep gemm does not take --stages"),
        (["--sweep", "decode", "--near", "--slots"], "one of --quick, --near, --layouts"),
        (["--sweep", "wgrad", "--shapes", "nomodel"], "--shapes 'nomodel' matches none of"),
    ],
    ids=["other-sweeps-option", "quick", "suite-option", "two-modes", "unknown-shape"],
)
def test_sweep_options_it_does_not_take_are_refused(capsys, argv, message):
    assert cli_main(["bench", *argv, "--list"]) == 2
    assert message in capsys.readouterr().out
