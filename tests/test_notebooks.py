"""The notebooks under notebooks/ (every *.ipynb there) are committed without outputs, and
each runs top to bottom on smollm2 (nbclient) in a fresh kernel of this very interpreter, so
in the same environment as the tests. A cell that raises fails the test (nbclient raises
CellExecutionError with the traceback); the executed copy is left in the test's tmp_path.
A notebook's last cells print sentinels ("DETERMINISTIC True") for what it shows, checked
here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest

from tests.conftest import real_model_file

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
# Per cell: the slowest are the first requests of each step shape, which compile.
CELL_TIMEOUT = 300
# What a notebook must print, beyond running without an error.
SENTINELS = {
    "01_python_api.ipynb": ["JSON_OK True"],
    "02_determinism.ipynb": ["DETERMINISTIC True"],
    "03_receipts.ipynb": ["RECEIPT_OK True"],
}


def _ids(path: Path) -> str:
    return path.name


def test_the_notebooks_are_there():
    assert set(SENTINELS) <= {p.name for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids)
def test_notebook_is_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"{path.name}, cell {i}: outputs not stripped (clear all outputs before "
                f"committing)")


def _this_python_kernel():
    """A kernel manager whose kernel is this interpreter (sys.executable), whatever kernel
    specs are installed: a user's own `python3` spec would otherwise win and run another
    Python, without kinetic or with another one."""
    from jupyter_client import AsyncKernelManager
    from jupyter_client.kernelspec import KernelSpec

    spec = KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f",
                            "{connection_file}"],
                      display_name="Python 3 (the tests' interpreter)", language="python")

    class ThisPython(AsyncKernelManager):
        @property
        def kernel_spec(self):
            return spec

    return ThisPython


def _printed(cell) -> str:
    return "".join(o.text for o in cell.get("outputs", [])
                   if o.output_type == "stream" and o.name == "stdout")


@pytest.mark.real_model
@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids)
def test_notebook_runs_top_to_bottom(path, tmp_path):
    from nbclient import NotebookClient
    from nbformat.v4 import new_code_cell

    real_model_file("smollm2")   # fetched (or the test skipped, saying why) before a kernel
    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(0, new_code_cell("import sys\nprint(sys.executable)"))
    client = NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_manager_class=_this_python_kernel(),
                            resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()   # raises CellExecutionError, with the traceback, at a failing cell
    finally:
        nbformat.write(nb, tmp_path / path.name)   # the executed copy, to look at
    assert _printed(nb.cells[0]).strip() == sys.executable
    printed = "\n".join(_printed(cell) for cell in nb.cells)
    for sentinel in SENTINELS.get(path.name, []):
        assert sentinel in printed.splitlines(), f"{path.name} did not print {sentinel!r}"
