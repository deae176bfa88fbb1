"""graph/allowlist.txt is what graph/allowlist.py writes with the torch the node is built for:
its schemas, the rules on argument values, and the operators found to return an input (each run
on sample arguments, in a child process: the generator also fails on a kernel that dies)."""
import subprocess
import sys

from conftest import ROOT


def test_the_allowlist_is_what_the_generator_writes(tmp_path):
    written = tmp_path / "allowlist.txt"
    subprocess.run([sys.executable, str(ROOT / "graph" / "allowlist.py"), str(written)], check=True, timeout=600)
    committed = (ROOT / "graph" / "allowlist.txt").read_text()
    assert written.read_text() == committed, "run graph/allowlist.py and commit graph/allowlist.txt"
    for line in ("returns-input aten::type_as", "rule aten::grid_sampler_2d padding_mode one-of 0 1 2"):
        assert line in committed.splitlines()
