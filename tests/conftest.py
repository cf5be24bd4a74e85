"""Shared fixtures: small profiles and clusters built in code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.schema import Profile, load_document

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture()
def tiny_profile() -> Profile:
    profile: Profile = load_document("profile", str(ROOT / "examples" / "profiles" / "tiny.json"))
    return profile


@pytest.fixture()
def tiny_profile_dict() -> dict:
    return json.loads((ROOT / "examples" / "profiles" / "tiny.json").read_text())
