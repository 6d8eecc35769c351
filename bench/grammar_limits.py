"""Hostile grammars: how fast they are refused, and what they cost everyone else (issue 30).

    python bench/grammar_limits.py [--repeats 3] [--hostile 4] [--leave-after 1.0]
        [--cases huge_choice,at_limit_schema,at_limit_grammar] [--pythonpath DIR]
        [--json out.json] [-- SERVER FLAGS...]

Starts ``trio-llm serve`` (`tests.support.server_process.SMALL_SERVER_ARGS` unless flags
are given after ``--``), then:

1. *Refusal*: issue 30's request, a ``structured_outputs.choice`` of 100,000 strings
   (2.3 MB), ``--repeats`` times: its status and how long its answer took.
2. *Newcomer alone*: a small new JSON Schema (3 properties, never seen before, so it must
   be compiled; ``max_tokens`` 4), ``--repeats`` times: its latency.
3. Per case, ``--repeats`` rounds of: ``--hostile`` clients each send a hostile request
   and leave after ``--leave-after`` seconds (as issue 30's attacker did); 0.2 s later
   the newcomer (another new small schema) is sent. Printed: the newcomer's latency, the
   hostile answers' statuses and times (or "left"), and the CPU seconds the API process
   and the engine used from the round's start until both were idle again (no CPU for
   0.5 s) or 60 s passed.

   - ``huge_choice``: issue 30's 100,000-string choice list.
   - ``at_limit_schema``: a new JSON Schema at the limits (5 objects of 999 optional
     integer properties and 5 more, 4,995 + 5 properties, about 180 KB), distinct per
     client: the costliest schema this server accepts that was measured.
   - ``at_limit_grammar``: a new Lark grammar of about 64 KiB of distinct literals, one
     alternative each (llguidance's lexer is superlinear in them).

Figures only; nothing is asserted. ``--pythonpath DIR`` runs the server from another
checkout (say, a worktree of main) for a before/after comparison; start the script from
outside the repository then.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import trio
from common import parse_server_args, print_table, server_env, write_json
from fairness import cpu_model
from process_cpu import cpu_seconds, role

from tests.support.procfs import descendants
from tests.support.server_process import SMALL_SERVER_ARGS, ServerProcess

QUESTION = [{"role": "user", "content": "Describe a city."}]
HUGE_CHOICE = [f"option number {i:06d} of the hostile list" for i in range(100_000)]
_serial = itertools.count()


def newcomer_body() -> dict[str, Any]:
    """A small JSON Schema no request used before (its compile cannot be cached)."""
    n = next(_serial)
    schema = {
        "type": "object",
        "properties": {
            f"name_{n}": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "ok": {"type": "boolean"},
        },
        "required": [f"name_{n}", "age", "ok"],
        "additionalProperties": False,
    }
    form = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    return {"messages": QUESTION, "max_tokens": 4, "temperature": 0, "response_format": form}


def hostile_body(case: str) -> dict[str, Any]:
    """One hostile request of ``case`` (distinct per call where caching would help)."""
    n = next(_serial)
    if case == "huge_choice":
        choice = {"choice": HUGE_CHOICE}
        return {"messages": QUESTION, "max_tokens": 4, "structured_outputs": choice}
    if case == "at_limit_schema":
        objects = {
            f"o{k}": {
                "type": "object",
                "properties": {f"h{n}_{k}_{i}": {"type": "integer"} for i in range(999)},
            }
            for k in range(5)
        }
        schema = {"type": "object", "properties": objects}
        form = {"type": "json_schema", "json_schema": {"name": "wide", "schema": schema}}
        return {"messages": QUESTION, "max_tokens": 4, "response_format": form}
    if case == "at_limit_grammar":
        literals, size = [], 0
        for i in itertools.count():
            literal = json.dumps(f"{n}x{i:x}")
            if size + len(literal) + 3 > 64 * 1024 - 16:
                break
            literals.append(literal)
            size += len(literal) + 3
        grammar = "start: " + " | ".join(literals)
        return {"messages": QUESTION, "max_tokens": 4, "guided_grammar": grammar}
    raise ValueError(case)


async def timed_post(
    client: httpx.AsyncClient, body: dict[str, Any], leave_after: float = 300.0
) -> tuple[str, float]:
    """POST a chat request; its status (or ``left`` if the client gave up and closed the
    connection after ``leave_after`` seconds) and the seconds it took."""
    start = time.perf_counter()
    with trio.move_on_after(leave_after):
        response = await client.post("/v1/chat/completions", json=body, timeout=None)
        return str(response.status_code), time.perf_counter() - start
    return "left", time.perf_counter() - start


class Cpu:
    """CPU seconds of the API process and the engine core(s) (their roles' sum)."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid
        self.pids = [server_pid, *sorted(descendants(server_pid))]

    def sample(self) -> dict[str, float]:
        used: dict[str, float] = {}
        for pid in self.pids:
            name = role(pid, self.server_pid)
            used[name] = used.get(name, 0.0) + cpu_seconds(pid)
        return used


async def until_idle(cpu: Cpu, limit: float = 60.0) -> dict[str, float]:
    """Wait until no process of the server used CPU for 0.5 s (or ``limit`` s); the last
    sample."""
    deadline = time.perf_counter() + limit
    last = cpu.sample()
    while time.perf_counter() < deadline:
        await trio.sleep(0.5)
        now = cpu.sample()
        if all(now[k] - last[k] < 0.02 for k in now):
            return now
        last = now
    return last


async def run(url: str, server_pid: int, args: argparse.Namespace) -> dict[str, Any]:
    cpu = Cpu(server_pid)
    results: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=url) as client:
        await timed_post(client, newcomer_body())  # llguidance and the path warmed up
        refusals = [
            await timed_post(client, hostile_body("huge_choice")) for _ in range(args.repeats)
        ]
        results["refusal"] = refusals
        name = "100,000 choices (2.3 MB)"
        table = [{"request": name, "status": s, "seconds": t} for s, t in refusals]
        print_table(table, ["request", "status", "seconds"])
        alone = [(await timed_post(client, newcomer_body()))[1] for _ in range(args.repeats)]
        results["newcomer_alone"] = alone
        runs = [round(t, 2) for t in alone]
        rows = [{"case": "(none)", "newcomer_s": statistics.median(alone), "runs": runs}]
        for case in args.cases.split(","):
            rounds = []
            for _ in range(args.repeats):
                await until_idle(cpu)
                before = cpu.sample()
                hostile: list[tuple[str, float]] = []
                newcomer: list[tuple[str, float]] = []

                async def one_hostile(case: str = case, out: list = hostile) -> None:
                    out.append(await timed_post(client, hostile_body(case), args.leave_after))

                async def one_newcomer(out: list = newcomer) -> None:
                    await trio.sleep(0.2)
                    out.append(await timed_post(client, newcomer_body()))

                async with trio.open_nursery() as nursery:
                    for _ in range(args.hostile):
                        nursery.start_soon(one_hostile)
                    nursery.start_soon(one_newcomer)
                after = await until_idle(cpu)
                used = {k: after[k] - before[k] for k in after}
                rounds.append(
                    {
                        "newcomer": newcomer[0],
                        "hostile": hostile,
                        "api_cpu_s": used.get("api server", 0.0),
                        "engine_cpu_s": used.get("engine core", 0.0),
                    }
                )
            results[case] = rounds
            latencies = [r["newcomer"][1] for r in rounds]
            rows.append(
                {
                    "case": f"{case} x{args.hostile}",
                    "newcomer_s": statistics.median(latencies),
                    "runs": [round(t, 2) for t in latencies],
                    "newcomer_status": ",".join(sorted({r["newcomer"][0] for r in rounds})),
                    "hostile": " ".join(f"{s}@{t:.2f}" for s, t in rounds[-1]["hostile"]),
                    "api_cpu_s": statistics.median(r["api_cpu_s"] for r in rounds),
                    "engine_cpu_s": statistics.median(r["engine_cpu_s"] for r in rounds),
                }
            )
        print()
        columns = ["case", "newcomer_s", "runs", "newcomer_status", "hostile"]
        print_table(rows, [*columns, "api_cpu_s", "engine_cpu_s"])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hostile", type=int, default=4)
    parser.add_argument("--leave-after", type=float, default=1.0)
    parser.add_argument("--cases", default="huge_choice,at_limit_schema,at_limit_grammar")
    args = parse_server_args(parser)
    flags = args.server_flags or [*SMALL_SERVER_ARGS, "--dtype", "float32"]
    env = server_env(args)
    print(f"CPU: {cpu_model()}, {len(os.sched_getaffinity(0))} cores; flags: {flags}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(flags, log_path=Path(tmp) / "server.log", env=env)
        with server:
            results = trio.run(run, server.url, server.pid, args)
    write_json(args.json, {"cpu": cpu_model(), "flags": flags, **results})


if __name__ == "__main__":
    main()
