"""Build a big trace from a real one by replicating its profiled steps.

Each copy is shifted in time by the span of the original and gets fresh correlation,
External id, flow and sequence ids and step numbers, so the big trace is a valid Kineto
trace of many steps, not many overlapping copies of one.
"""

from __future__ import annotations

import copy
import gzip
import json
import re
from pathlib import Path

_STEP = re.compile(r"^ProfilerStep#(\d+)$")


def replicate(src: str | Path, dst: str | Path, target_bytes: int) -> dict:
    """Write ``dst`` (uncompressed JSON) of about ``target_bytes``; return what was built."""
    raw = Path(src).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    data = json.loads(raw)
    events = data.pop("traceEvents")
    meta = [e for e in events if e.get("ph") == "M"]
    body = [e for e in events if e.get("ph") != "M" and e.get("cat") != "Trace"]
    t0 = min(e["ts"] for e in body)
    span = max(e["ts"] + e.get("dur", 0) for e in body) - t0 + 100.0
    steps = [int(m.group(1)) for e in body if (m := _STEP.match(str(e.get("name", ""))))]
    n_steps = max(steps) - min(steps) + 1 if steps else 1

    def top(key: str) -> int:
        return max((int(e.get("args", {}).get(key, 0) or 0) for e in body), default=0) + 1

    ext_span, corr_span, seq_span = top("External id"), top("correlation"), top("Sequence number")
    flow_span = max((int(e["id"]) for e in body if isinstance(e.get("id"), int)), default=0) + 1
    corr_span = max(corr_span, flow_span)
    body_bytes = sum(len(json.dumps(e)) + 2 for e in body)
    copies = max(1, -(-target_bytes // body_bytes))
    header = json.dumps(data)[:-1]
    with open(dst, "w") as f:
        f.write(header + ', "traceEvents": [\n')
        first = True
        for e in meta:
            f.write(("" if first else ",\n") + json.dumps(e))
            first = False
        for c in range(copies):
            for e in body:
                e2 = copy.copy(e)
                e2["ts"] = e["ts"] + c * span
                if "id" in e and isinstance(e["id"], int):
                    e2["id"] = e["id"] + c * (corr_span if e.get("cat") in ("ac2g", "async_gpu") else flow_span)
                if "args" in e:
                    a = dict(e["args"])
                    if "External id" in a:
                        a["External id"] += c * ext_span
                    if "correlation" in a:
                        a["correlation"] += c * corr_span
                    if "Sequence number" in a:
                        a["Sequence number"] += c * seq_span
                    e2["args"] = a
                m = _STEP.match(str(e.get("name", "")))
                if m:
                    e2["name"] = f"ProfilerStep#{int(m.group(1)) + c * n_steps}"
                f.write(("" if first else ",\n") + json.dumps(e2))
                first = False
        f.write("\n]}\n")
    return {"copies": copies, "events": copies * len(body) + len(meta),
            "bytes": Path(dst).stat().st_size, "steps_per_copy": len(set(steps))}


if __name__ == "__main__":
    import sys

    print(replicate(sys.argv[1], sys.argv[2], int(float(sys.argv[3]))))
