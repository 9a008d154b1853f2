"""The README's performance table quotes bench/results/, the raw output of each benchmark run."""
import re

from tests.support import REPO
README = (REPO / "docs" / "performance.md").read_text()


def performance_rows() -> list[list[str]]:
    section = README
    table = section[section.index("| what |"):].split("\n\n")[0].splitlines()[2:]  # less header and rule
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table]
    assert len(rows) >= 20, "the performance table is missing"
    return rows


def test_every_bold_figure_of_the_performance_table_is_in_its_results_file():
    for row in performance_rows():
        files = sorted((REPO / "bench" / "results").glob(f"{row[-1]}.txt"))
        assert files, f"{row[0]}: no bench/results/{row[-1]}.txt"
        text = "".join(f.read_text() for f in files).replace(",", "")
        for bold in re.findall(r"\*\*(.+?)\*\*", " | ".join(row[1:-1])):
            for number in re.findall(r"\d+\.\d+", bold.replace(",", "")):
                assert re.search(rf"(?<![\d.]){re.escape(number)}(?![\d])", text), \
                    f"{row[0]}: {number} is not in {', '.join(f.name for f in files)}"


def test_every_results_file_says_what_it_measured():
    for path in (REPO / "bench" / "results").glob("*.txt"):
        head = path.read_text().splitlines()[:4]
        assert re.match(r"commit: [0-9a-f]{40}", head[0]), path.name
        assert head[1].startswith("date: ") and head[2].startswith("nproc: "), path.name
        assert "load average before" in path.read_text() and "load average after" in path.read_text(), path.name
