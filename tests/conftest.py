"""Shared fixtures: ``start_broker`` starts real broker processes and kills them after the test.

It lives here, not in test_broker.py, so the modules that use it (test_broker, test_handshake,
test_snapshot) get it from pytest instead of importing it under the name of their test parameter.
"""
from __future__ import annotations

from typing import Any, List

import pytest
from test_broker import BrokerProc


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
