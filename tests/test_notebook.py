"""notebooks/quickstart.ipynb runs top to bottom without errors."""
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NB = Path(__file__).resolve().parent.parent / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_executes():
    nb = nbformat.read(NB, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NB.parent)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "logits (2, 24, 512) torch.float32" in outputs
    assert "decode == prefill: True" in outputs
    assert not any(o.get("output_type") == "error" for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
