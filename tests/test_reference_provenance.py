"""The shipped reference set was measured by this checkout's code (specter/ and baselines/ trees)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specter.code_provenance import stale_folders

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.xfail(strict=False, reason="results/reference is regenerated at HEAD in a later step")
def test_every_reference_folder_was_measured_at_heads_trees():
    stale = stale_folders(REPO / "results" / "reference", REPO)
    assert not stale, f"{len(stale)} folders measured by other code, e.g. {stale[:3]}"
