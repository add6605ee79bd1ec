"""The numbers README, ARTIFACT and docs (projection, load_efficiency) quote from the shipped set are generated (specter/figures/claims.py):
README's CPU speedup table is the generated one, and every decimal number in a `<!-- claims -->` region
is a value of the claims built from results/reference, or one of the paper's typed numbers."""

from __future__ import annotations

import csv
import re

import pytest
from conftest import REPO

from specter.figures.claims import DASH, claims_table
from specter.figures.data import ResultSet

DOCS = ("README.md", "ARTIFACT.md", "docs/projection.md", "docs/load_efficiency.md")
REGION = re.compile(r"<!-- claims -->(.*?)<!-- /claims -->", re.S)
DECIMAL = re.compile(r"(?<![\w.])\d+\.\d+(?![\d.]*\d)")


@pytest.fixture(scope="module")
def built():
    return claims_table(ResultSet(REPO / "results" / "reference", REPO / "results" / "paper"))


def claim_values(table) -> set[str]:
    values = set()
    for v in table["value"]:
        values |= set(str(v).split(DASH))
    return values


def paper_values() -> set[float]:
    out = set()
    for path in (REPO / "results" / "paper").glob("*.csv"):
        with path.open(newline="", encoding="utf-8") as f:
            for row in csv.reader(f):
                for cell in row:
                    try:
                        out.add(float(cell))
                    except ValueError:
                        pass
    return out


def unclaimed(text: str, values: set[str], paper: set[float]) -> list[str]:
    """Decimal numbers of `text`'s claims regions that are neither a claim nor a paper number at their digits."""
    found = []
    for region in REGION.findall(text):
        for number in DECIMAL.findall(region):
            digits = len(number.split(".")[1])
            if number in values or any(round(p, digits) == float(number) for p in paper):
                continue
            found.append(number)
    return found


def test_readme_speedup_table_is_the_generated_one(built):
    _, table = built
    assert table in (REPO / "README.md").read_text(), "README's CPU speedup table differs from claims.py's:\n" + table


@pytest.mark.parametrize("doc", DOCS)
def test_every_number_in_a_claims_region_is_generated(built, doc):
    text = (REPO / doc).read_text()
    assert REGION.search(text), f"{doc} has no claims region"
    assert unclaimed(text, claim_values(built[0]), paper_values()) == []


def test_a_stale_number_is_caught(built):
    values, paper = claim_values(built[0]), paper_values()
    text = "<!-- claims -->α 0.93–0.96 (the paper: 0.966); 0.55× <!-- /claims --> outside 9.87"
    assert unclaimed(text, values, paper) == []
    assert unclaimed(text.replace("0.55", "0.57"), values, paper) == ["0.57"]
    assert unclaimed(text.replace("0.966", "0.977"), values, paper) == ["0.977"]
