"""Two generations over one WebSocket connection; the second is cancelled after a while.

make serve                      # in one terminal
.venv/bin/python examples/ws_client.py
.venv/bin/python examples/ws_client.py --url ws://127.0.0.1:9000/v1/ws --cancel-after 8

The chat answer streams to the end; the story is cancelled once it has
``--cancel-after`` tokens, and its `done` event reports finish_reason "abort".
"""

from __future__ import annotations

import argparse

import trio

from trio_llm.client import DeltaEvent, DoneEvent, WSClient, open_ws_client


async def chat(client: WSClient, max_tokens: int) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    async for event in client.generate(
        "chat", id="question", messages=messages, max_tokens=max_tokens, temperature=0
    ):
        if isinstance(event, DoneEvent):
            print(f"[question] done: {event.choices[0]['finish_reason']}, {event.usage}")


async def story(client: WSClient, cancel_after: int) -> None:
    tokens = 0
    text = ""
    async with client.generate(
        "completion", id="story", prompt="Once upon a time", max_tokens=1000, ignore_eos=True
    ) as generation:
        async for event in generation:
            if isinstance(event, DeltaEvent):
                tokens += event.num_tokens
                text += event.text
                if tokens >= cancel_after:
                    await generation.cancel()  # the `done` event follows
            elif isinstance(event, DoneEvent):
                reason = event.choices[0]["finish_reason"]
                print(f"[story] {text!r}")
                print(f"[story] done after {tokens} tokens: {reason}, {event.usage}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="ws://127.0.0.1:8000/v1/ws")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--cancel-after", type=int, default=12, help="tokens of the story")
    args = parser.parse_args()
    async with open_ws_client(args.url, api_key=args.api_key) as client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(chat, client, args.max_tokens)
            nursery.start_soon(story, client, args.cancel_after)


if __name__ == "__main__":
    trio.run(main)
