"""The HTTP and WebSocket server of the API server process: the ASGI app and its routes
(`trio_llm.api.app`, the table in `trio_llm.api.http.routes`), the request models of the
OpenAI, Anthropic Messages and vLLM APIs and their validation, the translation of each
request into the engine's `SamplingParams` and prompt, and the response formats (JSON,
server-sent events, WebSocket events), errors and metrics.

It talks to the engine core through `trio_llm.frontend`'s engine client. Nothing is
imported here: import the modules themselves.
"""
