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
