"""docs/library.md as written: its ```python blocks run in order in one namespace (a notebook), in a
temporary directory, on the tiny preset on CPU; an error names the block's number and first line."""
import os
import re
import tempfile
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "library.md"


def blocks() -> list[str]:
    return [code for _, code in fenced()]


def fenced() -> list[tuple[str, str]]:
    """(file name or "", code) of each ```python block: a block marked `file=NAME` is a file a later
    block runs (written, not executed)."""
    return re.findall(r"^```python(?: file=(\S+))?\n(.*?)^```$", GUIDE.read_text(), re.S | re.M)


def test_the_guide_has_its_sections_and_code():
    text = GUIDE.read_text()
    for title in ("A custom training loop", "make_train_step", "Saving and loading", "Hugging Face",
                  "torch.func", "planner and the inspector", "data loader", "Seams", "Several processes"):
        assert re.search(rf"^## \d\. .*{re.escape(title)}", text, re.M), title
    assert len(blocks()) >= 10
    assert "docs/library.md" in (ROOT / "README.md").read_text()


@pytest.mark.launch  # section 9 launches its own loop with torchrun
def test_every_code_block_of_the_guide_runs_in_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the snippets' tempfile.mkdtemp() lands here
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the launched ranks share the cores
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    scope: dict = {"__name__": "library_guide"}
    for n, (name, code) in enumerate(fenced(), 1):
        if name:
            (tmp_path / name).write_text(code)
            continue
        first = code.strip().splitlines()[0]
        try:
            exec(compile(code, f"docs/library.md block {n}", "exec"), scope)
        except Exception as e:  # noqa: BLE001 - reported with the block that raised it
            pytest.fail(f"docs/library.md block {n} ({first!r}) raised {type(e).__name__}: {e}\n"
                        f"{traceback.format_exc()}", pytrace=False)
    assert os.listdir(tmp_path)  # the snippets wrote their files under the temporary directory
