"""Every figure of the performance docs comes from the place in a results file under bench/results/ named beside it.

The performance docs are docs/performance.md, the README's Figures section and docs/partitions.md's Measured
section. Each block of them (a paragraph, a list item, a table row) that holds a number names the results
file(s) it quotes and the lines it quotes them from, as `bench/results/NAME.txt:LINES` (LINES: line numbers and
ranges, `4,21-22,26-27`); every number in the block, prose included, is on those lines of those files, not
merely somewhere in the file. A file so quoted was written by bench/record.py at a commit that is in this
repository's history, from a clean tree.
"""
import re
import subprocess

import pytest

from tests.support import REPO

RESULTS = REPO / "bench" / "results"
# A quoted file and the lines quoted from it.
CITED = re.compile(r"bench/results/([\w.-]+\.txt)(?::(\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*))?")
# A number in the docs: not part of a word (a commit hash, p95, 64x5), thousands with commas.
DOC_NUMBER = re.compile(r"(?<![\w.])\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\w)|(?<![\w.])\d+(?:\.\d+)?(?!\w)")
# A number in a results file: units may follow it (0.72s, 64x, 0.30%).
FILE_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?")
# The most lines one block may quote from one file: a place, not the file again.
MOST_LINES = 40


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
    """Paragraphs, list items and table rows: the units that name their file and lines. Headings and code blocks
    hold none. A table row names its own: it quotes no line the paragraph above it names."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    out: list[str] = []
    for para in re.split(r"\n\s*\n", text):
        lines = para.strip().splitlines()
        if not lines or lines[0].startswith("#"):
            continue
        if lines[0].startswith("|"):
            out += [line for line in lines if not re.match(r"^\|[-| :]+\|$", line)][1:]  # rows, less the header
        elif lines[0].startswith(("- ", "* ")):
            out += [item for item in re.split(r"\n(?=[-*] )", para.strip())]
        else:
            out.append(para.strip())
    return out


def numbers(text: str) -> list[str]:
    text = re.sub(r"\]\([^)]*\)", "]", CITED.sub(" ", text))  # a link's target is no figure
    text = re.sub(r"bench/record\.py [\w.-]+", "bench/record.py", text)  # nor the name record.py gave the file
    text = re.sub(r"(?<=\|)\s*[≤≥][^|]*(?=\|)", " ", text)  # nor a target column's goal (≤ 1.5×), which no run measured
    return [n.replace(",", "") for n in DOC_NUMBER.findall(text)]


def line_numbers(spec: str) -> list[int]:
    """`4,21-22,26-27` -> [4, 21, 22, 26, 27]."""
    out = []
    for part in spec.split(","):
        first, _, last = part.partition("-")
        out += range(int(first), int(last or first) + 1)
    return out


def quoted(block: str) -> list[tuple[str, str]]:
    """(file, lines) of each place the block quotes; lines "" where it names none."""
    return [(name, spec or "") for name, spec in CITED.findall(block)]


def place_numbers(name: str, spec: str) -> set[str]:
    """The numbers on the named lines of a results file (a line past its end, or a range backwards: an error)."""
    # Thousands separators out (1,558,957), a list's commas kept (--nodes 16,64).
    lines = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", (RESULTS / name).read_text()).splitlines()
    wanted = line_numbers(spec)
    for part in spec.split(","):
        first, _, last = part.partition("-")
        assert int(first) <= int(last or first), f"bench/results/{name}:{spec}: {part} runs backwards"
    assert all(1 <= n <= len(lines) for n in wanted), f"bench/results/{name}:{spec}: it has {len(lines)} lines"
    assert len(set(wanted)) <= MOST_LINES, f"bench/results/{name}:{spec}: more than {MOST_LINES} lines is no place"
    return {n for i in wanted for n in FILE_NUMBER.findall(lines[i - 1])}


def unplaced(block: str) -> list[str]:
    """The numbers of a block that are not on the lines it quotes (all of them where it quotes no line)."""
    places = quoted(block)
    known = set().union(*(place_numbers(name, spec) for name, spec in places if spec)) if places else set()
    return [n for n in numbers(block) if n not in known]


def cited_blocks():
    for doc, text in performance_docs().items():
        for block in blocks(text):
            yield doc, block


def test_every_number_of_the_performance_docs_is_on_the_lines_of_the_results_file_named_beside_it():
    checked = 0
    for doc, block in cited_blocks():
        found = numbers(block)
        if not found:
            continue
        places = quoted(block)
        assert places, f"{doc}: figures without a results file named beside them: {block[:160]!r}"
        for name, spec in places:
            assert (RESULTS / name).exists(), f"{doc}: no bench/results/{name}"
            assert spec, f"{doc}: bench/results/{name} is quoted without the lines quoted (NAME.txt:LINES): " \
                         f"{block[:160]!r}"
        missing = unplaced(block)
        where = ", ".join(f"{name}:{spec}" for name, spec in places)
        assert not missing, f"{doc}: {', '.join(missing)} not on the lines quoted ({where}): {block[:160]!r}"
        checked += len(found)
    assert checked >= 600, "the performance docs have lost their figures"


def test_a_quoted_file_was_measured_at_a_commit_of_this_repository_from_a_clean_tree():
    shallow = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--is-shallow-repository"],
                             capture_output=True, text=True).stdout.strip() == "true"
    files = {name for _, block in cited_blocks() for name, _ in quoted(block)}
    assert len(files) >= 10
    for name in sorted(files):
        head = (RESULTS / name).read_text().splitlines()[0]
        m = re.fullmatch(r"commit: ([0-9a-f]{40})", head)
        assert m, f"bench/results/{name}: {head!r} (a tree with uncommitted changes is no commit to quote)"
        if not shallow:
            known = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{m.group(1)}^{{commit}}"])
            assert known.returncode == 0, f"bench/results/{name}: commit {m.group(1)} is not in this repository"


@pytest.mark.parametrize("block,ok", [
    ("64 nodes: start 1.24× (`bench/results/scale-3ef7c7a.txt:29,41`)", True),
    ("64 nodes: start 1.25× (`bench/results/scale-3ef7c7a.txt:29,41`)", False),  # a figure the file does not hold
    ("64 nodes: status 0.70× (`bench/results/scale-3ef7c7a.txt:29,41`)", False),  # in the file, not on those lines
    ("64 nodes: start 1.24× (`bench/results/scale-3ef7c7a.txt`)", False),  # no lines named
    ("200 nodes start in 84 s", False),  # no file named
])
def test_the_check_finds_a_figure_that_is_not_at_the_place_it_names(block, ok):
    places = quoted(block)
    assert (bool(places) and all(spec for _, spec in places) and not unplaced(block)) is ok


@pytest.mark.parametrize("spec, why", [("30-2", "runs backwards"), ("40-50", "it has 43 lines"),
                                       ("1-41", "more than 40 lines")])
def test_a_place_past_the_end_backwards_or_the_whole_file_is_refused(spec, why):
    with pytest.raises(AssertionError, match=why):
        place_numbers("scale-3ef7c7a.txt", spec)


def test_every_results_file_says_what_it_measured():
    for path in RESULTS.glob("*.txt"):
        head = path.read_text().splitlines()[:4]
        assert re.match(r"commit: [0-9a-f]{40}", head[0]), path.name
        assert head[1].startswith("date: ") and head[2].startswith("nproc: "), path.name
        assert "load average before" in path.read_text() and "load average after" in path.read_text(), path.name
