"""One adapter builder: every adapter (the DDP hook, the Megatron patches, the data-parallel
mode) takes its policy default, its telemetry recorder and its close from
``commsched.adapter``."""

import os
import re

import pytest

from commsched.adapter import (DATA_PARALLEL, DDP_HOOK, MEGATRON, POLICY_DEFAULTS,
                               adapter_config)
from commsched.config import Config

ROOT = os.path.join(os.path.dirname(__file__), "..")
ADAPTERS = ("hooks", "megatron_patches", os.path.join("commsched", "data_parallel"))


def _adapter_sources():
    for folder in ADAPTERS:
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    yield os.path.relpath(path, ROOT), open(path).read()


def test_policy_defaults():
    assert POLICY_DEFAULTS == {DDP_HOOK: "priority", MEGATRON: "fifo",
                               DATA_PARALLEL: "priority"}
    for adapter, policy in POLICY_DEFAULTS.items():
        assert adapter_config(Config(), adapter).policy == policy


@pytest.mark.parametrize("adapter", sorted(POLICY_DEFAULTS))
def test_a_policy_the_config_sets_wins_over_the_adapters_default(adapter):
    for policy in ("fifo", "priority"):
        assert adapter_config(Config(policy=policy), adapter).policy == policy


def test_adapters_resolve_no_policy_and_open_no_recorder_of_their_own():
    own = re.compile(r"with_policy\(|policy=\"(fifo|priority)\"|open_(rank_)?recorder\(")
    found = [(path, m.group(0)) for path, text in _adapter_sources()
             for m in own.finditer(text)]
    assert found == []
    users = {path.split(os.sep)[0] for path, text in _adapter_sources()
             if "build_scheduler(" in text}
    assert users == {"hooks", "megatron_patches", "commsched"}
