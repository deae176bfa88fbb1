#!/usr/bin/env python3
"""Runs every shell block the docs mark as runnable (a fence opened with ```sh runnable) in
README.md and docs/*.md, each in a fresh directory with the build's `djinn` first on PATH, and
fails on the first block that fails, printing it and its output. Processes a block leaves
running are stopped with it.
Usage: scripts/doc-blocks.py [DJINN_BIN_DIR, default target/debug]"""
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "target" / "debug").resolve()
BLOCK = re.compile(r"^```sh runnable\n(.*?)^```$", re.S | re.M)

docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ran = 0
for doc in docs:
    text = doc.read_text()
    for m in BLOCK.finditer(text):
        line = text[: m.start()].count("\n") + 1
        where = f"{doc.relative_to(ROOT)}:{line}"
        with tempfile.TemporaryDirectory() as cwd, open(f"{cwd}/.output", "w+") as log:
            env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "DJINN_STATE_DIR": f"{cwd}/state"}
            # Output to a file, not a pipe: what the block leaves in the background keeps the
            # pipe open, and the block's end is its shell's exit.
            proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", m.group(1)], cwd=cwd, env=env,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.returncode = -1
                log.write("(timed out after 120 s)\n")
            finally:
                # What the block started in the background goes with it.
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            log.seek(0)
            out = log.read()
        if proc.returncode != 0:
            print(f"{where}: the block failed ({proc.returncode}):\n{m.group(1)}\n{out}")
            sys.exit(1)
        print(f"{where}: ok")
        ran += 1
if ran == 0:
    sys.exit("no runnable block found: the docs lost theirs")
