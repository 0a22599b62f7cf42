"""The README's Python examples run as written, in order, in one namespace."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 3
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    out = capsys.readouterr().out
    assert "EvictionResult(layers=30" in out
    assert namespace["result"].total_rows_after == 30 * 128  # the own policy kept its budget
    assert namespace["HeavyHitters"].name in namespace["kvfn"].policy.POLICIES
