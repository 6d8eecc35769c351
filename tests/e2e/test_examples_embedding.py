"""examples/embed_trio.py and examples/offline_batch.py run with the default model.

Both scripts start their own engine; they run at once to share the wait for the model.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SMALL = ["--max-model-len", "512", "--num-threads", "1"]


def _start(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(EXAMPLES / script), *SMALL, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(process: subprocess.Popen[str]) -> str:
    try:
        out, err = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
    assert process.returncode == 0, err
    return out


def test_the_embedding_examples_run(real_model_dir: Path) -> None:
    embed = _start(
        "embed_trio.py", "--max-tokens", "16", "--long-tokens", "400", "--deadline", "0.5"
    )
    batch = _start("offline_batch.py", "--max-tokens", "12")
    try:
        embed_out, batch_out = _finish(embed), _finish(batch)
    finally:
        for process in (embed, batch):
            if process.poll() is None:
                process.kill()
                process.communicate()

    # A Trio app: the heartbeat ran beside the engine, the answer streamed, and the long
    # generation was cancelled by its deadline (aborted, well short of its 400 tokens).
    assert "[heartbeat 1]" in embed_out
    # `--dtype auto`: float32, or bfloat16 where this CPU has it and it measured faster.
    assert re.search(r"engine ready: (float32|bfloat16), context 512 tokens", embed_out)
    answer = embed_out.split("A: ", 1)[1].split("\n[finish:", 1)[0]
    assert "Paris" in answer
    assert re.search(r"\[finish: (stop|length), \d+ tokens\]", embed_out)
    cut = re.search(r"\[finish: cancelled, (\d+) of 400 tokens\]", embed_out)
    assert cut is not None, embed_out
    assert int(cut.group(1)) < 400

    # Synchronous code: three prompts (text, chat, text) in order, each with its output.
    finishes = re.findall(r"\[(\d+) tokens, finish: (stop|length)\]", batch_out)
    assert len(finishes) == 3, batch_out
    assert all(0 < int(count) <= 12 for count, _ in finishes)
    assert batch_out.startswith("'The capital of France is'\n  -> ")
    assert "Paris" in batch_out.split("\n")[1]
