"""The docs stay true to the code: every configuration field is documented, every make target the
README names exists, and every relative link points at a file."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from shared.config import ConsumerConfig, ProducerConfig

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("config", [ProducerConfig, ConsumerConfig])
def test_every_config_field_is_in_the_operations_doc(config):
    text = (ROOT / "docs/operations.md").read_text()
    missing = [f.name for f in dataclasses.fields(config) if f"--{f.name.replace('_', '-')}" not in text]
    assert missing == []


def test_make_targets_named_in_the_readme_exist():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", makefile, re.M))
    named = set(re.findall(r"`(?:sudo )?make ([a-z][a-z0-9-]*)", (ROOT / "README.md").read_text()))
    assert named and named - targets == set()


@pytest.mark.parametrize("doc", ["README.md", "docs/design.md", "docs/results.md", "docs/operations.md"])
def test_relative_links_resolve(doc):
    path = ROOT / doc
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", path.read_text()):
        assert (path.parent / target).exists(), f"{doc}: {target}"
