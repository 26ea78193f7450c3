"""Rebuild this fixture from a checkout of the public ``callanjfox/kv-cache-tester`` traces.

    python tests/data/weka_trimmed/trim.py PATH/TO/kv-cache-tester/traces

Writes ``trace_0010.json``, ``trace_0038.json``, ``trace_0056.json`` (whole requests kept
unchanged, some requests left out; see README.md) beside this file and ``../weka_gaps.json`` (the
tool gaps of all 40 traces, as ``vllm_mars.workload.weka.iter_gaps`` reads them).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: trace -> (top-level request indices kept, requests kept per sub-agent)
KEEP = {
    "trace_0010": ([0, 1, 2, 3, 10, 11, 12, 14, 15], 2),  # 4 Explore sub-agents, their first 2 calls
    "trace_0038": ([0, 15, 16], 0),                       # 31.8k -> 448.8k tokens: past a 262k window
    "trace_0056": ([0, 1], 0),                            # a 300.8k-token first prompt
}


def _dump(obj, path: Path) -> None:
    path.write_text(json.dumps(obj, separators=(",", ":")) + "\n", encoding="utf-8")


def main(src: Path) -> None:
    sys.path.insert(0, str(HERE.parents[2] / "vllm-mars"))
    from vllm_mars.workload import weka

    for name, (idx, per_sub) in KEEP.items():
        data = json.loads((src / f"{name}.json").read_text(encoding="utf-8"))
        reqs = [data["requests"][i] for i in idx]
        for r in reqs:
            if r["type"] == "subagent":
                r["requests"] = r["requests"][:per_sub]
        data["requests"] = reqs
        data.pop("totals", None)  # the whole session's sums: no longer true of the trimmed copy
        _dump(data, HERE / f"{name}.json")
    gaps = {f.stem: list(weka.iter_gaps(f)) for f in weka.trace_files(src)}
    _dump({"source": "callanjfox/kv-cache-tester traces/ (40 files), weka.iter_gaps(max_gap_s=300)",
           "gaps": gaps}, HERE.parent / "weka_gaps.json")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
