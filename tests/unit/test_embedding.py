"""`open_engine`, `AsyncEngine`, `Generation` and `LLM` on the tiny random model.

Each engine start costs seconds, so the API checks share two engines (one per detokenizer
mode, started at once) and every other test starts exactly one.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
import trio

import trio_llm
from tests.support.procfs import is_running, parent_pid, server_children
from trio_llm import LLM, AsyncEngine, SamplingParams, open_engine
from trio_llm.errors import EngineDeadError, EngineShutdownError, EngineStartupError

#: Starts engine processes: the slow tier.
pytestmark = pytest.mark.slow

MODES = ("inline", "process")
ENGINE_ARGS = {"max_model_len": 256, "num_kv_blocks": 64, "num_threads": 1}
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


def _our_children() -> set[int]:
    """Engine (and detokenizer) processes started by this test process itself."""
    return {pid for pid in server_children() if parent_pid(pid) == os.getpid()}


async def _run(engine: AsyncEngine, prompt, params: SamplingParams = GREEDY) -> dict:
    """Everything a generation delivered, joined."""
    outputs = []
    async with engine.generate(prompt, params) as generation:
        outputs = [out async for out in generation]
    assert all(not out.finished for out in outputs[:-1]) and outputs[-1].finished
    logprobs = None
    if params.logprobs is not None:
        logprobs = [entry for out in outputs for entry in out.logprobs]
    return {
        "text": "".join(out.text for out in outputs),
        "token_ids": [token for out in outputs for token in out.token_ids],
        "finish_reason": outputs[-1].finish_reason,
        "stop_reason": outputs[-1].stop_reason,
        "logprobs": logprobs,
        "num_output_tokens": outputs[-1].num_output_tokens,
    }


async def _wait_until_idle(engine: AsyncEngine) -> None:
    """Wait (with a deadline) until the engine reports no running request and every KV
    block free; it sends such stats as soon as aborts empty it."""
    client = engine.client
    with trio.fail_after(5):
        # Polled: the condition is another process's state, seen through its messages.
        while not (  # noqa: ASYNC110
            client.stats.last is not None
            and client.stats.last.num_running == 0
            and client.stats.last.num_free_blocks == engine.info.num_kv_blocks
        ):
            await trio.sleep(0.01)


async def _serve(model_dir: Path, mode: str, *, task_status: trio.TaskStatus[AsyncEngine]) -> None:
    async with open_engine(model_dir, detokenizer_mode=mode, **ENGINE_ARGS) as engine:
        task_status.started(engine)
        await trio.sleep_forever()


# ---------------------------------------------------------------- the API, both modes


async def _check_text_and_determinism(engine: AsyncEngine) -> dict:
    first = await _run(engine, "Once upon a time")
    assert first["finish_reason"] == "length" and first["stop_reason"] is None
    assert len(first["token_ids"]) == first["num_output_tokens"] == 24
    assert first["text"] == engine.tokenizer.decode(first["token_ids"])
    assert first["logprobs"] is None
    assert await _run(engine, "Once upon a time") == first
    return first


async def _check_concurrent_generations(engine: AsyncEngine) -> None:
    prompts = ["Once upon a time", "The sky is", [5, 6, 7], [{"role": "user", "content": "Hi"}]]
    alone = [await _run(engine, prompt) for prompt in prompts]
    together: list = [None] * len(prompts)
    steps_before = engine.client.stats.num_multi_request_steps

    async def one(i: int) -> None:
        together[i] = await _run(engine, prompts[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    assert together == alone
    assert engine.client.stats.num_multi_request_steps > steps_before  # batched


async def _check_leaving_the_block_aborts(engine: AsyncEngine) -> None:
    async with engine.generate("Once upon a time", LONG) as generation:
        async for out in generation:
            if out.num_output_tokens >= 2:
                break
    assert generation.entered and not generation.finished
    assert engine.client.num_in_flight == 0  # aborted on leaving, no waiting
    await _wait_until_idle(engine)
    with pytest.raises(RuntimeError, match="closed before its last output"):
        await generation.__anext__()
    with pytest.raises(RuntimeError, match="entered once"):
        await generation.__aenter__()


async def _check_a_deadline_in_a_plain_loop_aborts(engine: AsyncEngine) -> None:
    generation = engine.generate("Once upon a time", LONG)
    received = 0
    with trio.move_on_after(math.inf) as scope:
        async for out in generation:
            received = out.num_output_tokens
            if received >= 2:
                scope.deadline = trio.current_time()  # the next wait is cancelled
    assert scope.cancelled_caught
    assert not generation.entered and 2 <= received < LONG.max_tokens
    assert engine.client.num_in_flight == 0
    await _wait_until_idle(engine)


async def _check_invalid_inputs(engine: AsyncEngine) -> None:
    steps = engine.client.stats.num_steps
    too_long = [5] * engine.max_model_len
    for prompt, params, error, match in [
        ("", None, ValueError, "empty"),
        ([], None, ValueError, "empty"),
        ([engine.vocab_size], None, ValueError, "out of range"),
        ([-1], None, ValueError, "out of range"),
        ([1, "a"], None, TypeError, "token ids"),
        ([1, True], None, TypeError, "bool"),
        (123, None, TypeError, "not int"),
        (b"bytes", None, TypeError, "not bytes"),
        ([{"role": "user"}], None, ValueError, "content"),
        (too_long, None, ValueError, "at least one token must remain"),
        ("x " * 2000, None, ValueError, "context"),
        ("Hi", SamplingParams(max_tokens=300), ValueError, r"you requested \d+ tokens"),
        ("Hi", SamplingParams(temperature=-1.0), ValueError, "temperature"),
        ("Hi", SamplingParams(stop_token_ids=(10**6,)), ValueError, "token ids"),
        ("Hi", SamplingParams(prompt_logprobs=1), ValueError, "prompt_logprobs"),
        ("Hi", {"max_tokens": 3}, TypeError, "SamplingParams"),
    ]:
        with pytest.raises(error, match=match):
            engine.generate(prompt, params)
    assert engine.client.num_in_flight == 0 and engine.client.stats.num_steps == steps


async def _workload(engine: AsyncEngine, reference: dict) -> list[dict]:
    """Requests whose outputs must not depend on the detokenizer mode."""
    text = reference["text"]
    stop = text[len(text) // 2 :][:3]
    assert stop.strip(), text
    stopped = await _run(engine, "Once upon a time", msgspec.structs.replace(GREEDY, stop=(stop,)))
    assert (stopped["finish_reason"], stopped["stop_reason"]) == ("stop", stop)
    assert stopped["text"] == text[: text.index(stop)]
    assert stopped["token_ids"] == reference["token_ids"][: len(stopped["token_ids"])]
    with_logprobs = msgspec.structs.replace(
        GREEDY, stop=(stop,), include_stop_str_in_output=True, logprobs=2
    )
    included = await _run(engine, "Once upon a time", with_logprobs)
    assert included["text"] == text[: text.index(stop) + len(stop)]
    assert [entry.token_id for entry in included["logprobs"]] == included["token_ids"]
    stop_token = reference["token_ids"][5]
    by_token = await _run(
        engine, "Once upon a time", msgspec.structs.replace(GREEDY, stop_token_ids=(stop_token,))
    )
    assert (by_token["finish_reason"], by_token["stop_reason"]) == ("stop", stop_token)
    chat = await _run(engine, [{"role": "user", "content": "Hello!"}], GREEDY)
    return [stopped, included, by_token, chat]


async def test_the_generation_api_in_both_detokenizer_modes(tiny_model_dir: Path) -> None:
    engines: dict[str, AsyncEngine] = {}
    results: dict[str, list[dict]] = {}
    async with trio.open_nursery() as nursery:

        async def start(mode: str) -> None:
            engines[mode] = await nursery.start(_serve, tiny_model_dir, mode)

        async with trio.open_nursery() as starting:  # both models load at once
            for mode in MODES:
                starting.start_soon(start, mode)

        async def check(mode: str) -> None:
            engine = engines[mode]
            assert engine.client.detokenizes == (mode == "process")
            assert engine.max_model_len == 256 and engine.vocab_size == 49152
            await _check_invalid_inputs(engine)
            reference = await _check_text_and_determinism(engine)
            await _check_concurrent_generations(engine)
            await _check_leaving_the_block_aborts(engine)
            await _check_a_deadline_in_a_plain_loop_aborts(engine)
            results[mode] = [reference, *await _workload(engine, reference)]

        async with trio.open_nursery() as checking:
            for mode in MODES:
                checking.start_soon(check, mode)
        assert len(_our_children()) == 3  # two engine cores and one detokenizer
        nursery.cancel_scope.cancel()  # leaving the blocks by cancellation stops both
    assert results["inline"] == results["process"]
    assert _our_children() == set()
    with pytest.raises(EngineShutdownError):
        async with engines["inline"].generate("Hi"):
            pass  # pragma: no cover


# ---------------------------------------------------------------- lifetime


async def test_a_killed_engine_fails_the_generation_and_the_block(tiny_model_dir: Path) -> None:
    errors: list[EngineDeadError] = []
    with pytest.raises(EngineDeadError) as raised:
        async with open_engine(tiny_model_dir, **ENGINE_ARGS) as engine:
            generation = engine.generate("Once upon a time", LONG)
            async with generation:
                await generation.__anext__()  # generating
                os.kill(engine.info.pid, signal.SIGKILL)
                try:
                    async for _ in generation:
                        pass
                except EngineDeadError as exc:
                    errors.append(exc)
            await trio.sleep_forever()  # the block is cancelled by the engine's death
    assert len(errors) == 1
    assert type(raised.value) is EngineDeadError  # plain, not an exception group
    assert "SIGKILL" in str(raised.value)
    assert not engine.is_alive
    assert _our_children() == set()


async def test_leaving_the_block_with_an_exception_stops_the_engine(
    tiny_model_dir: Path,
) -> None:
    class Boom(Exception):
        pass

    with pytest.raises(Boom):  # plain, not an exception group
        async with open_engine(tiny_model_dir, detokenizer_mode="process", **ENGINE_ARGS) as engine:
            pid = engine.info.pid
            children = _our_children()
            assert pid in children and len(children) == 2
            async with engine.generate("Once upon a time", LONG) as generation:
                await generation.__anext__()
                raise Boom
    assert not is_running(pid)
    assert _our_children() == set()


async def test_bad_arguments_fail_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="'max_num_seq'"):
        async with open_engine(tmp_path, max_num_seq=4):
            pass  # pragma: no cover
    with pytest.raises(ValueError, match="max_model_len"):
        async with open_engine(tmp_path, max_model_len=0):
            pass  # pragma: no cover
    with pytest.raises(ValueError, match="detokenizer_mode"):
        async with open_engine(tmp_path, detokenizer_mode="thread"):
            pass  # pragma: no cover
    with pytest.raises(ValueError, match="chat_template: no such file"):
        async with open_engine(tmp_path, chat_template=tmp_path / "missing.jinja"):
            pass  # pragma: no cover
    with pytest.raises(ValueError, match="chat_template: invalid chat template"):
        async with open_engine(tmp_path, chat_template="{% for m in messages %}"):
            pass  # pragma: no cover
    assert _our_children() == set()


async def test_a_chat_template_replaces_the_models_own(tiny_model_dir: Path) -> None:
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    async with open_engine(tiny_model_dir, chat_template=template, **ENGINE_ARGS) as engine:
        messages = [{"role": "user", "content": "Hi"}]
        rendered = engine.tokenizer.render_chat(messages)
        assert rendered == "<user>Hi"
        # Chat prompts are rendered, then encoded without adding special tokens again.
        as_ids = engine.tokenizer.encode("<user>Hi", add_special_tokens=False)
        assert await _run(engine, messages) == await _run(engine, as_ids)


# ---------------------------------------------------------------- LLM


def test_llm_generates_batches_and_closes(tiny_model_dir: Path) -> None:
    llm = LLM(tiny_model_dir, **ENGINE_ARGS)
    with llm:
        pid = llm.info.pid
        assert [t.name for t in threading.enumerate()].count("trio-llm-engine") == 1
        assert llm.generate([]) == []
        prompts = ["Once upon a time", [5, 6, 7], [{"role": "user", "content": "Hi"}], [5, 6, 7]]
        results = llm.generate(prompts, GREEDY)
        assert [r.finish_reason for r in results] == ["length"] * 4
        assert results[1] == results[3]  # greedy, and in prompt order
        assert results[0].prompt_token_ids == llm.tokenizer.encode("Once upon a time")
        assert results[0].text == llm.tokenizer.decode(results[0].token_ids)
        assert llm.stats.num_multi_request_steps > 0  # submitted at once, batched
        (single,) = llm.generate([5, 6, 7], GREEDY)
        assert single == results[1]
        per_prompt = [
            msgspec.structs.replace(GREEDY, max_tokens=3),
            msgspec.structs.replace(GREEDY, max_tokens=5, logprobs=1),
        ]
        short, longer = llm.generate([[5, 6, 7], [5, 6, 7]], per_prompt)
        assert len(short.token_ids) == 3 and short.logprobs is None
        assert longer.token_ids[:3] == short.token_ids and len(longer.logprobs) == 5
        with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
            llm.generate(["Hi"], per_prompt)
        with pytest.raises(ValueError, match="empty"):
            llm.generate(["Hi", ""])
        _check_keyboard_interrupt_aborts_the_batch(llm)
        (after,) = llm.generate([5, 6, 7], GREEDY)
        assert after == results[1]
    assert not is_running(pid)
    assert _our_children() == set()
    assert "trio-llm-engine" not in [t.name for t in threading.enumerate()]
    llm.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("Hi")


def _check_keyboard_interrupt_aborts_the_batch(llm: LLM) -> None:
    """Ctrl-C in the calling thread while a batch runs: the batch is aborted, then
    KeyboardInterrupt is re-raised."""
    main = threading.main_thread()
    assert threading.current_thread() is main
    # Steps of earlier batches do not count (their last stats may still show requests).
    steps_before = llm.stats.num_steps

    def interrupt_once_generating() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # a condition wait with a deadline
            if llm.stats.num_steps > steps_before:  # this batch's first step is done
                signal.pthread_kill(main.ident, signal.SIGINT)
                return
            time.sleep(0.005)

    # Python's own Ctrl-C handler, whatever an earlier test in this process left installed:
    # once in the full suite the signal was sent and nothing was raised.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupter = threading.Thread(target=interrupt_once_generating)
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["Once upon a time", "The sky is"], LONG)
    finally:
        interrupter.join()
        signal.signal(signal.SIGINT, previous)
    deadline = time.monotonic() + 5
    while llm.stats.last.num_running or llm.stats.last.num_free_blocks != 64:
        assert time.monotonic() < deadline, llm.stats.last
        time.sleep(0.01)


def test_llm_bad_arguments_raise_in_the_constructor(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="'max_num_seq'"):
        LLM(tmp_path, max_num_seq=4)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        LLM(tmp_path, num_kv_blocks=0)
    with pytest.raises(ValueError, match="chat_template: no such file"):
        LLM(tmp_path, chat_template="missing.jinja")
    assert "trio-llm-engine" not in [t.name for t in threading.enumerate()]


def test_a_start_up_failure_is_raised_plain_by_the_constructor(tmp_path: Path) -> None:
    # LLM runs open_engine in its thread: the plain error proves open_engine raised it so.
    with pytest.raises(EngineStartupError, match="never downloads models") as raised:
        LLM(tmp_path / "missing", **ENGINE_ARGS)
    assert type(raised.value) is EngineStartupError
    assert _our_children() == set()
    assert "trio-llm-engine" not in [t.name for t in threading.enumerate()]


def test_importing_the_package_stays_light() -> None:
    code = (
        "import sys, trio_llm; "
        "print(sorted({'torch', 'transformers', 'trio_llm.async_engine'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_the_package_exports_the_embedding_api() -> None:
    assert trio_llm.open_engine is open_engine and trio_llm.LLM is LLM
    assert issubclass(trio_llm.EngineStartupError, trio_llm.EngineDeadError)
    assert {"open_engine", "AsyncEngine", "GenerationOutput", "LLM", "EngineDeadError"} <= set(
        trio_llm.__all__
    )
