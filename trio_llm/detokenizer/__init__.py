"""The detokenizer child of 3-process mode (``python -m trio_llm.detokenizer``).

It sits between the engine core and the API server and runs the same per-request output
assembly as inline mode (`trio_llm.text.output.RequestDetokenizer`); the text code itself
lives in `trio_llm.text`.
"""
