"""``python -m benchmarks run [--quick]``: the benchmark suite (see suite.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts import _common by name
from suite import main

sys.exit(main())
