"""`python -m repro.bugs.BUG [matrix options]`: its fixed and buggy variants side by side, the
tool's `repro matrix --bug BUG` in this process's place (the catalogue imports nothing of it)."""

import os
import sys

BUG = __spec__.parent.rpartition(".")[2]
os.execv(sys.executable, [sys.executable, "-m", "repro", "matrix", "--bug", BUG, *sys.argv[1:]])
