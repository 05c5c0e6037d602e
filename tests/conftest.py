"""Shared fixtures over tests/support: ``roles`` (broker, learner and workers by their CLI on shared ports,
all stopped after the test) and ``start_broker`` (real broker processes, killed after the test).

They live here so the modules that use them get them from pytest; no test module imports another.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, List

import pytest
from support.procs import BrokerProc, Roles


@pytest.fixture
def roles(tmp_path: Path) -> Iterator[Roles]:
    r = Roles(tmp_path)
    yield r
    r.close()


@pytest.fixture
def start_broker():
    started: List[BrokerProc] = []

    def start(*overrides: str, **kw: Any) -> BrokerProc:
        b = BrokerProc(*overrides, **kw)
        started.append(b)
        return b

    yield start
    for b in started:
        b.kill()
