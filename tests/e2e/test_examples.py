"""The HTTP examples in examples/ run as documented against a real server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
FRANCE = "What is the capital of France?"


def _run(command: list[str], **kwargs) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, **kwargs)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _example(name: str, *args: str) -> str:
    """What the Python example ``name`` printed, run with ``args``."""
    return _run([sys.executable, str(EXAMPLES / name), *args])


def test_openai_chat_example_streams_an_answer(base_url: str) -> None:
    out = _example("openai_chat.py", "--base-url", base_url, "--max-tokens", "24", FRANCE)
    answer, _, usage = out.rpartition("\n[")
    assert "Paris" in answer
    assert usage.strip().endswith("tokens]")
    assert 0 < int(usage.split()[0]) <= 24


def test_curl_example_gets_a_chat_answer_and_a_stream(base_url: str) -> None:
    out = _run(["sh", str(EXAMPLES / "curl.sh")], env={"URL": base_url, "PATH": "/usr/bin:/bin"})
    first_line, _, rest = out.partition("\n")
    reply = json.loads(first_line)
    assert reply["object"] == "chat.completion"
    assert reply["choices"][0]["message"]["content"]
    events = [line.removeprefix("data: ") for line in rest.splitlines() if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    assert 0 < usage["completion_tokens"] <= 32  # unseeded sampling may end on EOS


def test_websocket_example_streams_one_answer_and_cancels_the_other(base_url: str) -> None:
    url = base_url.replace("http://", "ws://") + "/v1/ws"
    out = _example("ws_client.py", "--url", url, "--cancel-after", "6")
    lines = out.splitlines()
    question = next(line for line in lines if line.startswith("[question] done:"))
    assert question.split()[2] in ("stop,", "length,")
    cancelled = next(line for line in lines if line.startswith("[story] done after"))
    assert ": abort," in cancelled
    # Cancelled long before its 1,000 tokens.
    assert int(cancelled.split()[3]) < 100


def test_tool_calls_example_makes_a_call_and_answers_from_its_result(base_url: str) -> None:
    out = _example("tool_calls.py", "--base-url", base_url)
    call, answer = out.strip().splitlines()[-2:]
    assert call.startswith("call: get_weather(")
    arguments = json.loads(call.removeprefix("call: get_weather(").split(") -> ")[0])
    assert arguments["city"] == "Paris"
    assert arguments["unit"] in ("celsius", "fahrenheit")
    assert answer.startswith("answer: ") and len(answer) > len("answer: ")


def test_other_apis_example_answers_through_both(base_url: str) -> None:
    out = _example("other_apis.py", "--base-url", base_url, "--max-tokens", "24", FRANCE)
    lines = out.splitlines()
    messages = next(line for line in lines if line.startswith("[messages:"))
    responses = next(line for line in lines if line.startswith("[responses:"))
    assert "Paris" in out.split("[messages:")[0]
    assert messages.split("stop_reason ")[1].split(",")[0] in ("end_turn", "max_tokens")
    assert responses.split(": ")[1].split(",")[0] in ("completed", "incomplete")
    assert "Paris" in out.split("[messages:")[1].split("[responses:")[0]
