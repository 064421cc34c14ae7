"""Fixtures of the learner tests (helper functions are in learner_support.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_policy_factory(tiny_model):
    """Builds a fresh Policy on the tiny model (each test gets its own adapters)."""
    from learner.policy import Policy

    def make(**kwargs):
        return Policy(tiny_model, device="cpu", **kwargs)

    return make
