"""Every figure of the performance docs comes from a results file under bench/results/, named beside it.

The performance docs are docs/performance.md and the README's Figures section. Each block of them (a
paragraph, a list item, a table row) that holds a number names the results file(s) it quotes, as
`bench/results/NAME.txt`; every number in the block, prose included, is in those files. A file so quoted
was written by bench/record.py at a commit that is in this repository's history, from a clean tree.
"""
import re
import subprocess

import pytest

from tests.support import REPO

RESULTS = REPO / "bench" / "results"
CITED = re.compile(r"bench/results/([\w.-]+\.txt)")
# A number in the docs: not part of a word (a commit hash, p95, 64x5), thousands with commas.
DOC_NUMBER = re.compile(r"(?<![\w.])\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\w)|(?<![\w.])\d+(?:\.\d+)?(?!\w)")
# A number in a results file: units may follow it (0.72s, 64x, 0.30%).
FILE_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?")


def section(text: str, heading: str) -> str:
    """The section of a markdown text under `heading` (a line "## ..."), to the next heading of its level."""
    start = text.index("\n%s\n" % heading)
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def performance_docs() -> dict[str, str]:
    readme = (REPO / "README.md").read_text()
    return {"README.md (Figures)": section(readme, "## Figures"),
            "docs/performance.md": (REPO / "docs" / "performance.md").read_text(),
            "docs/partitions.md (Measured)": section((REPO / "docs" / "partitions.md").read_text(), "## Measured")}


def blocks(text: str) -> list[str]:
    """Paragraphs, list items and table rows: the units that name their file. Headings and code blocks hold none.
    A table row that names no file quotes the files the paragraph just before its table names ("Run quoted: ...")."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    out: list[str] = []
    before = ""  # the paragraph before the current one
    for para in re.split(r"\n\s*\n", text):
        lines = para.strip().splitlines()
        if not lines or lines[0].startswith("#"):
            continue
        if lines[0].startswith("|"):
            above = " ".join("bench/results/%s" % name for name in CITED.findall(before))
            rows = [line for line in lines if not re.match(r"^\|[-| :]+\|$", line)][1:]  # rows, less the header
            out += [row if CITED.search(row) else "%s %s" % (row, above) for row in rows]
        elif lines[0].startswith(("- ", "* ")):
            out += [item for item in re.split(r"\n(?=[-*] )", para.strip())]
        else:
            out.append(para.strip())
        before = para
    return out


def numbers(text: str) -> list[str]:
    text = re.sub(r"\]\([^)]*\)", "]", CITED.sub(" ", text))  # a link's target is no figure
    text = re.sub(r"(?<=\|)\s*[≤≥][^|]*(?=\|)", " ", text)  # nor a target column's goal (≤ 1.5×), which no run measured
    return [n.replace(",", "") for n in DOC_NUMBER.findall(text)]


def file_numbers(name: str) -> set[str]:
    return set(FILE_NUMBER.findall((RESULTS / name).read_text().replace(",", "")))


def cited_blocks():
    for doc, text in performance_docs().items():
        for block in blocks(text):
            yield doc, block


def test_every_number_of_the_performance_docs_is_in_the_results_file_named_beside_it():
    checked = 0
    for doc, block in cited_blocks():
        found = numbers(block)
        if not found:
            continue
        files = CITED.findall(block)
        assert files, f"{doc}: figures without a results file named beside them: {block[:160]!r}"
        for name in files:
            assert (RESULTS / name).exists(), f"{doc}: no bench/results/{name}"
        known = set().union(*(file_numbers(name) for name in files))
        for n in found:
            assert n in known, f"{doc}: {n} is not in {', '.join(files)}: {block[:160]!r}"
            checked += 1
    assert checked >= 100, "the performance docs have lost their figures"


def test_a_quoted_file_was_measured_at_a_commit_of_this_repository_from_a_clean_tree():
    shallow = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--is-shallow-repository"],
                             capture_output=True, text=True).stdout.strip() == "true"
    quoted = {name for _, block in cited_blocks() for name in CITED.findall(block)}
    assert len(quoted) >= 10
    for name in sorted(quoted):
        head = (RESULTS / name).read_text().splitlines()[0]
        m = re.fullmatch(r"commit: ([0-9a-f]{40})", head)
        assert m, f"bench/results/{name}: {head!r} (a tree with uncommitted changes is no commit to quote)"
        if not shallow:
            known = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{m.group(1)}^{{commit}}"])
            assert known.returncode == 0, f"bench/results/{name}: commit {m.group(1)} is not in this repository"


@pytest.mark.parametrize("block,ok", [
    ("start 1.24× (`bench/results/scale-3ef7c7a.txt`)", True),
    ("start 1.25× (`bench/results/scale-3ef7c7a.txt`)", False),  # a figure the file does not hold
    ("200 nodes start in 84 s", False),  # no file named
])
def test_the_check_finds_a_figure_that_is_not_in_its_file(block, ok):
    files = CITED.findall(block)
    known = set().union(*(file_numbers(n) for n in files)) if files else set()
    assert (bool(files) and all(n in known for n in numbers(block))) is ok


def test_every_results_file_says_what_it_measured():
    for path in RESULTS.glob("*.txt"):
        head = path.read_text().splitlines()[:4]
        assert re.match(r"commit: [0-9a-f]{40}", head[0]), path.name
        assert head[1].startswith("date: ") and head[2].startswith("nproc: "), path.name
        assert "load average before" in path.read_text() and "load average after" in path.read_text(), path.name
