"""What every bench script sets up before it imports zerotune: the hub offline, src/ on the path, where results go
and the SmolLM2 checkpoint `make setup` unpacks. A script's own folder (bench/) is on sys.path, so `from bench_env
import ...` comes first in each."""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
if str(REPO / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "src"))
RESULTS = REPO / "bench" / "results"
SMOLLM2 = REPO / "assets" / "models" / "smollm2-135m-instruct"
