"""Fixtures of the chart tests: the real helm binary (fetched into .tools/ on first use)."""

from __future__ import annotations

import pytest

from chart_render import ensure_helm


@pytest.fixture(scope="session", autouse=True)
def helm_binary():
    return ensure_helm()
