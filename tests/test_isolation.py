"""The ``isolated`` marker of tests/conftest.py: the test body runs in a child process."""

import os

import pytest
from conftest import ISOLATED_CHILD


@pytest.mark.isolated
def test_an_isolated_test_runs_in_a_child_process():
    # Only the child that conftest's hook starts has the variable: the body fails in the parent.
    assert os.environ.get(ISOLATED_CHILD) == "1"
