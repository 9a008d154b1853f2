"""The top of the checkout holds what the project is made of, nothing a run left there."""
import subprocess

from tests.support import REPO


def tracked_top_level() -> list[str]:
    out = subprocess.run(["git", "-C", str(REPO), "ls-files"], capture_output=True, text=True, check=True).stdout
    return sorted({line.split("/")[0] for line in out.splitlines() if "/" not in line})


def test_no_tracked_file_at_the_top_is_empty_or_ignored():
    files = tracked_top_level()
    assert "README.md" in files
    for name in files:
        assert (REPO / name).stat().st_size > 0, f"{name}: an empty file at the top of the repository"
    ignored = subprocess.run(["git", "-C", str(REPO), "check-ignore", "--no-index", *files],
                             capture_output=True, text=True).stdout.split()
    assert not ignored, f"tracked, yet .gitignore says a run leaves them: {ignored}"


def test_gitignore_covers_what_runs_leave_at_the_top():
    left = ["slurm-1.out", "slurm-12345.out", "core", ".fabtrain/demo/token", "data/sample/x", "artifacts/a"]
    out = subprocess.run(["git", "-C", str(REPO), "check-ignore", "--no-index", *left],
                         capture_output=True, text=True).stdout.split()
    assert out == left
