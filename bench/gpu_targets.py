"""Issue 18's GPU target, as ``target: measured vs goal`` lines, from a device run's output.

    python bench/gpu_targets.py OUT_DIR

``OUT_DIR`` is where `bench/device_run.sh` wrote its JSON files: ``offline.json`` and
``offline_eager.json`` (bench/throughput.py, with and without CUDA graphs) and
``serve_vs_offline.json`` / ``serve_vs_offline_si8.json`` (the servers, the second with
``--stream-interval 8``, and the offline engine on the same prompts).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

#: Output tok/s of the offline engine on the seed workload (256 x 250 -> 200).
OFFLINE_GOAL = 25_000
#: Server output tok/s over the offline engine's, same prompts.
SERVER_GOAL = 0.97


def target_lines(out: Path) -> list[str]:
    """The lines for whatever results ``out`` holds (a missing file: said so)."""
    lines = []

    def load(name: str) -> dict | None:
        path = out / name
        return json.loads(path.read_text()) if path.exists() else None

    offline, eager = load("offline.json"), load("offline_eager.json")
    if offline is None:
        lines.append("target 4 (offline): no offline.json")
    else:
        rate = offline["output_tok_per_s"]
        line = (
            f"target 4 (offline, {offline['requests']} requests, {offline['system']}): "
            f"{rate:,.0f} output tok/s vs goal >= {OFFLINE_GOAL:,}"
        )
        if eager is not None and "cuda" not in offline["system"]:
            line += " (no CUDA graphs off a GPU)"
        elif eager is not None:
            eager_rate = eager["output_tok_per_s"]
            line += f"; eager {eager_rate:,.0f} (graphs {rate / eager_rate:.2f}x)"
        lines.append(line)
    for name, label in (
        ("serve_vs_offline.json", ""),
        ("serve_vs_offline_si8.json", ", --stream-interval 8"),
    ):
        both = load(name)
        if both is None:
            lines.append(f"target 4 (server / offline{label}): no {name}")
            continue
        base = both["offline"]["output_tok_per_s"]
        for mode, result in both["servers"].items():
            api = result["cpu_s"].get("api server", 0.0) / max(1, result.get("output_tokens", 0))
            lines.append(
                f"target 4 (server {mode} / offline{label}, same run): "
                f"{result['output_tok_per_s'] / base:.3f} vs goal >= {SERVER_GOAL}; "
                f"API server {api * 1e6:.0f} CPU µs per output token"
            )
    return lines


def main() -> None:
    for line in target_lines(Path(sys.argv[1])):
        print(line)


if __name__ == "__main__":
    main()
