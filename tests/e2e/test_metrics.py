"""/metrics counts tokens and requests exactly, and times every request it served."""

from __future__ import annotations

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import MODEL
from tests.support.sse import open_events

HISTOGRAMS = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
)


def _scrape(base_url: str) -> dict[str, float]:
    """Every sample as ``name{label=value,...}`` -> value, summed over engines (the
    model_name and engine labels dropped)."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k not in ("model_name", "engine")}
            key = sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(labels.items()))
            samples[key] = samples.get(key, 0.0) + sample.value
    return samples


def _delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after[key] - before.get(key, 0.0)


def test_a_finished_request_is_counted_and_timed(base_url: str) -> None:
    before = _scrape(base_url)
    body = {"model": MODEL, "prompt": "One, two, three,", "max_tokens": 7, "ignore_eos": True}
    reply = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).json()
    after = _scrape(base_url)
    usage = reply["usage"]
    assert usage["completion_tokens"] == 7
    assert _delta(before, after, "trio_llm:prompt_tokens_total") == usage["prompt_tokens"]
    assert _delta(before, after, "trio_llm:generation_tokens_total") == 7
    assert _delta(before, after, "trio_llm:request_success_total{finished_reason=length}") == 1
    assert _delta(before, after, "trio_llm:request_aborted_total") == 0
    for name in HISTOGRAMS:
        expected = 6 if name == "inter_token_latency_seconds" else 1  # gaps between 7 tokens
        assert _delta(before, after, f"trio_llm:{name}_count") == expected, name
        assert _delta(before, after, f"trio_llm:{name}_sum") >= 0, name
    # The first token cannot come before the request was scheduled, nor after it finished.
    ttft = _delta(before, after, "trio_llm:time_to_first_token_seconds_sum")
    e2e = _delta(before, after, "trio_llm:e2e_request_latency_seconds_sum")
    assert 0 < ttft <= e2e


def test_n_choices_and_a_stop_string_count_as_successes(base_url: str) -> None:
    before = _scrape(base_url)
    body = {
        "model": MODEL,
        "prompt": "1, 2, 3, 4, 5, 6,",
        "max_tokens": 12,
        "temperature": 0,
        "n": 2,
        "stop": [","],
    }
    reply = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).json()
    after = _scrape(base_url)
    assert [c["finish_reason"] for c in reply["choices"]] == ["stop", "stop"]
    assert _delta(before, after, "trio_llm:request_success_total{finished_reason=stop}") == 2
    assert _delta(before, after, "trio_llm:request_aborted_total") == 0
    generated = _delta(before, after, "trio_llm:generation_tokens_total")
    assert generated == reply["usage"]["completion_tokens"]


async def test_a_client_that_leaves_is_counted_as_aborted(base_url: str) -> None:
    before = _scrape(base_url)
    body = {
        "model": MODEL,
        "prompt": "Tell me a story.",
        "max_tokens": 500,
        "ignore_eos": True,  # it must still be running when the client leaves
        "stream": True,
    }
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        async with open_events(client, "/v1/completions", body) as events:
            await events.__anext__()  # one chunk, then hang up
    with trio.fail_after(10):
        while _delta(before, _scrape(base_url), "trio_llm:request_aborted_total") < 1:  # noqa: ASYNC110
            await trio.sleep(0.05)  # /metrics can only be observed by polling
    after = _scrape(base_url)
    assert _delta(before, after, "trio_llm:request_aborted_total") == 1
    assert _delta(before, after, "trio_llm:e2e_request_latency_seconds_count") == 0


def test_http_requests_are_counted_by_endpoint_and_status(base_url: str) -> None:
    before = _scrape(base_url)
    chat = [{"role": "user", "content": "Hi"}]
    calls = [
        ("/v1/chat/completions", {"model": MODEL, "messages": chat, "max_tokens": 2}),
        ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 2}),
        ("/v1/messages", {"model": MODEL, "messages": chat, "max_tokens": 2}),
        ("/v1/messages", {"model": MODEL, "messages": chat}),  # no max_tokens: 400
        ("/v1/no-such-endpoint", {}),
    ]
    statuses = [
        httpx.post(f"{base_url}{path}", json=body, timeout=60).status_code for path, body in calls
    ]
    assert statuses == [200, 200, 200, 400, 404]
    after = _scrape(base_url)

    def counted(endpoint: str, status: str) -> float:
        key = f"trio_llm:http_requests_total{{endpoint={endpoint}}}{{status={status}}}"
        return _delta(before, after, key)

    assert counted("/v1/chat/completions", "2xx") == 1
    assert counted("/v1/responses", "2xx") == 1
    assert counted("/v1/messages", "2xx") == 1
    assert counted("/v1/messages", "4xx") == 1
    assert counted("other", "4xx") == 1
    # Each generating request is also an engine request counted as a success.
    successes = sum(
        _delta(before, after, f"trio_llm:request_success_total{{finished_reason={reason}}}")
        for reason in ("stop", "length")
    )
    assert successes == 3
