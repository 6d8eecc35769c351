"""What the guarded sandbox of a request's chat template costs (issue 41), and how fast
each hostile template is stopped.

    python bench/template_guard.py [--messages 2000] [--repeats 5] [--timeout 2]

Renders trio_llm's shipped SmolLM2 tool template over ``--messages`` messages and 20 tools
with the server's own renderer (`render_messages`, trusted) and with the guarded one
(`render_guarded`, as for a request's ``chat_template``): the best of ``--repeats``
milliseconds each. Then renders each hostile template of
tests/unit/text/test_request_chat_template.py under ``--timeout`` and prints how long until
its refusal and the process's peak RSS after it. Figures only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.unit.text.test_request_chat_template import HOSTILE  # noqa: E402
from trio_llm.text.chat_template import TemplateError, render_messages, shipped_template  # noqa: E402
from trio_llm.text.template_guard import TemplateLimits, render_guarded  # noqa: E402


def best_ms(run, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=2.0)
    args = parser.parse_args()
    source = shipped_template("smollm2_tools.jinja")
    roles = ("user", "assistant")
    messages = [
        {"role": roles[i % 2], "content": "hello there " * 20} for i in range(args.messages)
    ]
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
        for i in range(20)
    ]
    variables = {"messages": messages, "tools": tools, "add_generation_prompt": True}
    limits = TemplateLimits(args.timeout, 10**8)
    plain = best_ms(lambda: render_messages(source, messages, tools=tools), args.repeats)
    guarded = best_ms(lambda: render_guarded(source, dict(variables), limits), args.repeats)
    print(f"SmolLM2 tool template, {args.messages} messages, 20 tools:")
    print(f"  trusted renderer {plain:.1f} ms, guarded {guarded:.1f} ms ({guarded / plain:.1f}x)")
    print(f"hostile templates (timeout {args.timeout:g} s, cap 100,000 characters):")
    small = {"messages": messages[:1], "tools": None, "add_generation_prompt": True}
    for name, (hostile, _says) in HOSTILE.items():
        start = time.perf_counter()
        try:
            render_guarded(hostile, dict(small), TemplateLimits(args.timeout, 100_000))
            outcome = "rendered"
        except TemplateError as exc:
            outcome = str(exc)[:70]
        seconds = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
        print(f"  {name:22} {seconds:6.3f} s  peak RSS {peak:4d} MiB  {outcome}")


if __name__ == "__main__":
    main()
