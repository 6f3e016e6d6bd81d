"""The DeepSpeed adapter accepts the installed release and refuses, by name, one it was not
tested with or one whose pipeline internals changed."""

from __future__ import annotations

import configparser
import os

import deepspeed
import pytest
from deepspeed.pipe import PipelineModule

from vlmshard.train import deepspeed_compat
from vlmshard.train.deepspeed_compat import DeepSpeedCompatError, check_compatible

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_installed_deepspeed_is_the_tested_one():
    check_compatible()


def test_setup_pins_the_tested_range():
    setup = configparser.ConfigParser()
    setup.read(os.path.join(ROOT, "setup.cfg"))
    (low_major, low_minor), (high_major, high_minor) = deepspeed_compat.TESTED_RANGE
    pin = f"deepspeed>={low_major}.{low_minor},<{high_major}.{high_minor}"
    assert pin in setup["options"]["install_requires"].split()


def test_an_untested_release_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(deepspeed, "__version__", "0.31.2")
    with pytest.raises(DeepSpeedCompatError, match=r"deepspeed 0\.31\.2 is installed.*"
                                                   r"deepspeed>=0\.19,<0\.20"):
        check_compatible()


@pytest.mark.parametrize("change", ["removed", "renamed parameters"])
def test_changed_internals_are_refused(monkeypatch, change):
    if change == "removed":
        monkeypatch.delattr(PipelineModule, "_set_bounds")
    else:
        monkeypatch.setattr(PipelineModule, "_set_bounds", lambda self, first, last: None)
    with pytest.raises(DeepSpeedCompatError, match=r"PipelineModule\._set_bounds\(start, stop\)"):
        check_compatible()
