"""`fab check`'s probe asks torch about CUDA only where torch was built with a GPU backend: the build is read from
the torch/version.py that build wrote, without importing torch (2 to 3 s of CPU a node)."""
from __future__ import annotations

import pytest

from fabtrain.node import probe
from tests.conftest import require_import

CPU_BUILD = """from typing import Optional

__all__ = ['__version__', 'debug', 'cuda', 'git_version', 'hip', 'rocm', 'xpu']
__version__ = '2.13.0+cpu'
debug = False
cuda: Optional[str] = None
git_version = 'cf30153c4c131c8164ee7798e5022d810682e2cb'
hip: Optional[str] = None
rocm: Optional[str] = None
xpu: Optional[str] = None
"""


@pytest.mark.parametrize("text, gpu", [
    (CPU_BUILD, False),
    (CPU_BUILD.replace("cuda: Optional[str] = None", "cuda: Optional[str] = '12.4'"), True),
    (CPU_BUILD.replace("hip: Optional[str] = None", "hip: Optional[str] = '6.2.41133'"), True),
    ("__version__ = '1.13.1'\ncuda = '11.7'\nhip = None\n", True),  # an older build's plain assignments
    ("__version__ = '1.13.1'\ncuda = None\nhip = None\n", False),
    ("__version__ = '2.13.0'\n", True),  # no word of its backends: torch is asked
    ("cuda = (\n", True),  # not Python: torch is asked
])
def test_the_build_is_read_from_its_version_file(tmp_path, text, gpu):
    f = tmp_path / "version.py"
    f.write_text(text)
    assert probe.torch_has_gpu_build(str(f)) is gpu


def test_a_missing_version_file_asks_torch(tmp_path):
    assert probe.torch_has_gpu_build(str(tmp_path / "nothing.py")) is True


def test_the_installed_cpu_build_says_what_importing_it_says():
    """The CI's torch is a CPU build: read from its file, no GPU build, and torch imported says the same (no CUDA,
    no device), so the probe's reply is the one the import gave."""
    require_import("torch", "torch", "installed by `make test` (requirements-test.txt)")
    assert probe.torch_has_gpu_build() is False
    assert probe.torch_cuda_by_import() == (None, 0)
