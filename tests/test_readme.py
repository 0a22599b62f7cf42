"""The README's and the docs' Python examples run as written, each file's in order in one
namespace."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["docs/api.md", "docs/policies.md"]  # the pages whose code blocks are runnable


def run_blocks(path: Path) -> dict:
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)
    assert blocks, f"{path} has no Python example"
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(path), "exec"), namespace)
    return namespace


def test_readme_python_blocks_run(capsys):
    namespace = run_blocks(ROOT / "README.md")
    assert "EvictionResult(layers=30" in capsys.readouterr().out
    assert namespace["result"].total_rows_after == 30 * 128  # the own policy kept its budget
    assert namespace["HeavyHitters"].name in namespace["kvfn"].policies.POLICIES
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("page", DOCS)
def test_docs_python_blocks_run(page):
    run_blocks(ROOT / page)


def test_docs_pages_exist_and_are_linked():
    readme = (ROOT / "README.md").read_text()
    for page in ["docs/architecture.md", "docs/serving.md", "docs/evaluation.md",
                 "docs/benchmarks.md", *DOCS]:  # fmt: skip
        assert (ROOT / page).is_file() and f"]({page})" in readme, page
