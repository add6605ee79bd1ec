"""README's two commands are the ones CI runs, and no relative link in the docs is broken."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# a markdown link: [text](target); images and reference-style links are not used here
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _bash_lines(text):
    """Every line inside a ```bash block."""
    lines, inside = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            inside = line.strip() == "```bash"
            continue
        if inside:
            lines.append(line)
    return lines


def _ci_lines():
    return [l for l in (ROOT / ".ci" / "run").read_text().splitlines() if l.strip()]


def test_command_1_is_what_ci_runs():
    ci = _ci_lines()
    install = next(l.strip() for l in ci if l.strip().startswith("pip install -q -c constraints.txt -e ."))
    run = next(l.strip() for l in ci if l.strip().startswith("python run.py"))
    # CI runs the two halves on separate lines (quietly, and teeing the output); README joins them
    expected = " && ".join([install.replace(" -q", ""), run.split(" |")[0]])
    assert expected == "pip install -c constraints.txt -e . && python run.py"
    assert expected in _bash_lines(README.read_text())


def test_command_2_is_cis_last_line_verbatim():
    last = _ci_lines()[-1]
    assert "pytest" in last
    assert last in _bash_lines(README.read_text())


def _doc_files():
    return [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "ARTIFACT.md", ROOT / "results" / "README.md"]


def test_readme_is_one_screen_per_purpose():
    assert len(README.read_text().splitlines()) <= 300


def test_every_relative_link_points_at_a_file():
    broken = []
    for doc in _doc_files():
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a web address or an anchor within the page
            path = target.split("#", 1)[0]
            if not (doc.parent / path).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, "broken links: " + ", ".join(broken)


def test_the_link_pattern_sees_links():
    # guard against a pattern that silently matches nothing
    assert "docs/benchmarks.md" in LINK.findall(README.read_text())
