"""Load shedding: a burst of 3×N requests against ``--max-num-waiting-requests N``.

    python bench/load_shedding.py [--max-num-waiting-requests 8] [--max-num-seqs 4] \\
        [--burst-factor 3] [--max-tokens 32] [--input-len 64] [--model M] [--json out.json]

Starts ``trio-llm serve`` with a waiting line of N (``--max-num-waiting-requests``) and a
small running batch (``--max-num-seqs``), times one request alone (the baseline), then
sends ``burst-factor × N`` streamed completions at the same instant (sonnet prompts of
``--input-len`` tokens, ``--max-tokens`` output tokens with ``ignore_eos``) while polling
``/metrics``. Records each request's status, latency, time to its first text, and for each
503 its ``Retry-After`` and error code. Then one more normal request, then SIGINT.

What it can prove about the limit, from outside the server. The server counts a request as
*waiting* from its admission until its first output; it answers 503 when N are waiting.

- Upper bound: an admitted request's (a 200's) waiting time lies inside [client sent it,
  client saw its first text], so the most of these intervals that overlap is at least the
  most requests that were ever waiting at once. If that overlap is at most N, the limit
  provably held. (A larger overlap proves nothing: a request may be admitted after
  another's first token was produced but before its client read it.) ``/metrics``'
  scheduler queue (``trio_llm:num_requests_waiting``), sampled during the burst, must also
  stay at most N.
- Lower bound: each 503 was answered while N requests were waiting, and each of those
  has its 200, so any 503 implies at least N admitted requests.

Prints the figures. Exits 1 if a request hung (no answer within ``--deadline``), got a
status other than 200 or 503, a 200 stream did not end properly, a 503 had no
``Retry-After``, a limit check failed, the final request failed, or the server did not
exit 0 on SIGINT (or left its engine process behind).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import trio
from common import SchedulerMaxima, print_table, sonnet_prompts, write_json

from tests.support.procfs import engine_children, is_running
from tests.support.server_process import ServerProcess
from tests.support.sse import DONE, delta_text
from trio_llm.config import DEFAULT_MODEL, default_cache_dir
from trio_llm.model_files.loader import resolve_model_dir
from trio_llm.text.tokenizer import Tokenizer


@dataclass
class Outcome:
    """How one request of the burst ended (times in seconds from the burst's start)."""

    index: int
    status: int | None = None  # None: no response (hung, or a transport error)
    sent: float = 0.0
    first_text: float | None = None  # 200 only: when the first text arrived
    done: float | None = None  # when the response ended (None: never)
    retry_after: str | None = None
    error_code: str | None = None
    output_tokens: int = 0
    problem: str = ""  # non-empty: something other than a clean 200 or 503

    @property
    def latency(self) -> float | None:
        """Seconds from sending to the end of the response."""
        return None if self.done is None else self.done - self.sent


@dataclass
class MetricsSamples(SchedulerMaxima):
    """Maxima of the scheduler gauges sampled from /metrics during the burst."""

    samples: int = 0


async def send_one(
    client: httpx.AsyncClient, body: dict[str, Any], outcome: Outcome, t0: float
) -> None:
    """POST ``body`` as a stream and fill ``outcome`` (status, times, Retry-After, tokens)."""
    outcome.sent = time.perf_counter() - t0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                content = await response.aread()
                outcome.done = time.perf_counter() - t0
                outcome.retry_after = response.headers.get("retry-after")
                try:
                    outcome.error_code = json.loads(content)["error"]["code"]
                except (ValueError, KeyError, TypeError):
                    outcome.problem = f"not an OpenAI error body: {content[:200]!r}"
                if response.status_code != 503:
                    outcome.problem = f"HTTP {response.status_code}: {content[:300]!r}"
                elif outcome.retry_after is None:
                    outcome.problem = "503 without Retry-After"
                return
            ended = False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == DONE:
                    ended = True
                    break
                event = json.loads(data)
                if "error" in event:
                    outcome.problem = f"error event: {event['error'].get('message')}"
                if event.get("usage"):
                    outcome.output_tokens = event["usage"]["completion_tokens"]
                if outcome.first_text is None and delta_text(event):
                    outcome.first_text = time.perf_counter() - t0
            outcome.done = time.perf_counter() - t0
            if not ended:
                outcome.problem = outcome.problem or "stream ended without [DONE]"
    except (httpx.HTTPError, ValueError) as exc:
        outcome.problem = f"transport: {exc!r}"


async def poll_metrics(client: httpx.AsyncClient, samples: MetricsSamples, interval: float) -> None:
    """Sample /metrics every ``interval`` seconds until cancelled, keeping the maxima."""
    while True:
        response = await client.get("/metrics")
        samples.samples += 1
        samples.add_scrape(response.text)
        await trio.sleep(interval)


async def timed_request(
    client: httpx.AsyncClient, body: dict[str, Any], deadline: float
) -> tuple[int | None, float]:
    """One non-streamed request: (status, seconds); status None if it failed or hung."""
    start = time.perf_counter()
    status = None
    with trio.move_on_after(deadline):
        try:
            status = (await client.post("/v1/completions", json=body)).status_code
        except httpx.HTTPError:
            pass
    return status, time.perf_counter() - start


async def run(args: argparse.Namespace, base_url: str, prompts: list[list[int]]) -> dict:
    """Baseline request, the burst with /metrics polling, then the final request."""
    size = len(prompts)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(None)  # the deadline is a cancel scope around the whole burst

    def body(prompt: list[int], stream: bool) -> dict[str, Any]:
        return {
            "prompt": prompt,
            "max_tokens": args.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {}),
        }

    async with (
        httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client,
        httpx.AsyncClient(base_url=base_url, timeout=timeout) as monitor,
    ):
        baseline_status, baseline = await timed_request(
            client, body(prompts[0], False), args.deadline
        )

        outcomes = [Outcome(i) for i in range(size)]
        samples = MetricsSamples()
        go = trio.Event()
        t0 = 0.0

        async def fire(i: int, task_status=trio.TASK_STATUS_IGNORED) -> None:
            task_status.started()
            await go.wait()
            await send_one(client, body(prompts[i], True), outcomes[i], t0)

        with trio.move_on_after(args.deadline) as deadline:
            async with trio.open_nursery() as watch:
                if args.poll_interval > 0:
                    watch.start_soon(poll_metrics, monitor, samples, args.poll_interval)
                async with trio.open_nursery() as burst:
                    for i in range(size):
                        await burst.start(fire, i)  # parked on go.wait()
                    t0 = time.perf_counter()
                    go.set()  # every request is sent now
                watch.cancel_scope.cancel()  # the burst is over: stop polling
        elapsed = time.perf_counter() - t0
        final_status, final_latency = await timed_request(
            client, body(prompts[0], False), args.deadline
        )

    return {
        "baseline_status": baseline_status,
        "baseline_s": baseline,
        "outcomes": outcomes,
        "hung": deadline.cancelled_caught,
        "burst_s": elapsed,
        "metrics": samples,
        "final_status": final_status,
        "final_s": final_latency,
    }


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals [start, end] that contain one common instant."""
    edges = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    # At equal times, starts (+1) sort after ends (-1): touching intervals do not overlap.
    best = current = 0
    for _, step in edges:
        current += step
        best = max(best, current)
    return best


def analyse(args: argparse.Namespace, result: dict) -> tuple[dict, list[str]]:
    """The figures and the list of failed checks."""
    n = args.max_num_waiting_requests
    outcomes: list[Outcome] = result["outcomes"]
    hung = [o for o in outcomes if o.done is None and not o.problem]
    admitted = [o for o in outcomes if o.status == 200]
    ok = [o for o in admitted if o.done is not None and not o.problem]
    shed = [o for o in outcomes if o.status == 503]
    other = [o for o in outcomes if o not in ok and o not in shed and o not in hung]
    ok_lat = [o.latency for o in ok if o.latency is not None]
    shed_lat = [o.latency for o in shed if o.latency is not None]
    ttft = [o.first_text - o.sent for o in ok if o.first_text is not None]
    # Waiting ends by the first text; without text, by the end; if neither came, never.
    overlap = max_overlap(
        [
            (o.sent, next(t for t in (o.first_text, o.done, math.inf) if t is not None))
            for o in admitted
        ]
    )
    samples: MetricsSamples = result["metrics"]
    failures = []
    if result["hung"] or hung:
        failures.append(f"{len(hung)} requests hung past the {args.deadline:g} s deadline")
    failures += [f"request {o.index}: {o.problem or f'HTTP {o.status}'}" for o in other]
    failures += [f"request {o.index}: {o.problem}" for o in shed if o.problem]
    short = [o.index for o in ok if o.output_tokens != args.max_tokens]
    if short:
        failures.append(f"200s with other than {args.max_tokens} tokens: {short}")
    if shed and len(admitted) < n:
        failures.append(
            f"{len(shed)} refused although only {len(admitted)} (< N={n}) were admitted"
        )
    if samples.max_waiting > n and not samples.preemptions:
        failures.append(f"/metrics showed {samples.max_waiting:.0f} waiting > N={n}")
    if result["baseline_status"] != 200 or result["final_status"] != 200:
        failures.append(
            f"baseline / final request got HTTP {result['baseline_status']} / "
            f"{result['final_status']}"
        )
    figures = {
        "burst": len(outcomes),
        "ok_200": len(ok),
        "admitted": len(admitted),
        "shed_503": len(shed),
        "other": len(other),
        "hung": len(hung),
        "burst_s": result["burst_s"],
        "baseline_s": result["baseline_s"],
        "ok_latency_median_s": _median(ok_lat),
        "ok_latency_max_s": max(ok_lat, default=0.0),
        "ok_ttft_median_s": _median(ttft),
        "shed_latency_median_s": _median(shed_lat),
        "shed_latency_max_s": max(shed_lat, default=0.0),
        "retry_after": sorted({o.retry_after for o in shed if o.retry_after is not None}),
        "error_codes": sorted({o.error_code for o in shed if o.error_code is not None}),
        "max_waiting_overlap": overlap,
        "limit_proved": overlap <= n,
        "metrics_samples": samples.samples,
        "metrics_max_waiting": samples.max_waiting,
        "metrics_max_running": samples.max_running,
        "metrics_preemptions": samples.preemptions,
        "final_s": result["final_s"],
    }
    return figures, failures


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def report(args: argparse.Namespace, figures: dict, shutdown: str, failures: list[str]) -> None:
    """Print the figures and the verdict."""
    n, seqs = args.max_num_waiting_requests, args.max_num_seqs
    print(
        f"burst of {figures['burst']} streamed completions ({args.max_tokens} tokens each) "
        f"at --max-num-waiting-requests {n} --max-num-seqs {seqs}; "
        f"burst took {figures['burst_s']:.2f} s"
    )
    columns = ["status", "count", "latency_median_s", "latency_max_s"]
    rows = [
        {
            "status": "200",
            "count": figures["ok_200"],
            "latency_median_s": figures["ok_latency_median_s"],
            "latency_max_s": figures["ok_latency_max_s"],
        },
        {
            "status": "503",
            "count": figures["shed_503"],
            "latency_median_s": figures["shed_latency_median_s"],
            "latency_max_s": figures["shed_latency_max_s"],
        },
        {"status": "other", "count": figures["other"]},
        {"status": "hung", "count": figures["hung"]},
    ]
    print_table(rows, columns)
    baseline = figures["baseline_s"]
    ratio = figures["shed_latency_max_s"] / baseline if baseline else 0.0
    print(
        f"one request alone: {baseline:.3f} s; slowest 503: {figures['shed_latency_max_s']:.3f} s"
        f" ({ratio:.1%} of it); 200s' median time to first text "
        f"{figures['ok_ttft_median_s']:.3f} s"
    )
    print(f"503s: Retry-After {figures['retry_after']}, error.code {figures['error_codes']}")
    overlap = figures["max_waiting_overlap"]
    verdict = "the limit provably held" if figures["limit_proved"] else "inconclusive"
    print(
        f"most admitted requests between sending and first text at once: {overlap} (N={n}): "
        f"{verdict}; "
        f"any 503 implies at least N admitted: {figures['admitted']} >= {n} "
        f"{'yes' if figures['admitted'] >= n or not figures['shed_503'] else 'NO'}"
    )
    print(
        f"/metrics over {figures['metrics_samples']} samples: scheduler waiting max "
        f"{figures['metrics_max_waiting']:.0f}, running max {figures['metrics_max_running']:.0f}"
        f", preemptions {figures['metrics_preemptions']:.0f}"
    )
    print(f"final request: {figures['final_s']:.3f} s; shutdown: {shutdown}")
    if failures:
        print("FAILED:")
        for line in failures:
            print("  " + line)
    else:
        print("OK: nothing hung, every answer was a 200 or a fast 503")


def main() -> None:
    """Start the server, run the burst, stop the server with SIGINT; exit 1 on a failure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-num-waiting-requests", type=int, default=8, metavar="N")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--burst-factor", type=int, default=3, help="the burst is this × N")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64, help="prompt tokens")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--deadline",
        type=float,
        default=600.0,
        help="seconds for the burst (and each of the lone requests before and after it) to end",
    )
    parser.add_argument(
        "--poll-interval", type=float, default=0.02, help="/metrics, seconds (0: no polling)"
    )
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads (engine)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    tokenizer = Tokenizer.load(resolve_model_dir(args.model, default_cache_dir()))
    prompts = sonnet_prompts(
        tokenizer, args.burst_factor * args.max_num_waiting_requests, args.input_len
    )
    server_args = [
        "--model",
        args.model,
        "--dtype",
        args.dtype,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-waiting-requests",
        str(args.max_num_waiting_requests),
        "--max-model-len",
        str(args.input_len + args.max_tokens + 16),
        *(["--num-threads", str(args.num_threads)] if args.num_threads else []),
    ]
    log = Path(tempfile.mkdtemp(prefix="load-shedding-")) / "server.log"
    server = ServerProcess(server_args, log_path=log, env={"TRIO_LLM_API_KEY": ""})
    server.start()
    try:
        engines = engine_children(server.pid)
        result = trio.run(run, args, server.url, prompts)
        code = server.stop()
        left = [pid for pid in engines if is_running(pid)]
    finally:
        server.close()
    figures, failures = analyse(args, result)
    shutdown = f"SIGINT -> exit {code}" + (f", engine {left} still running" if left else "")
    if code != 0 or left:
        failures.append(f"shutdown: {shutdown} (log: {log})")
    report(args, figures, shutdown, failures)
    write_json(
        args.json,
        {
            "figures": figures,
            "failures": failures,
            "requests": [asdict(o) for o in result["outcomes"]],
        },
    )
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
