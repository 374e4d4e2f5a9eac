"""With ``BCG_GRAPH_CENSUS`` naming a directory, every CUDA graph this process captures appends its
node census there (``tests/gpu/graph_census.py``). A diagnostic put first on PYTHONPATH by hand."""

import os
import sys

if os.environ.get("BCG_GRAPH_CENSUS"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        import graph_census

        graph_census.install(os.environ["BCG_GRAPH_CENSUS"])
    except Exception as exc:  # noqa: BLE001
        print(f"graph census not installed: {exc!r}", file=sys.stderr)
