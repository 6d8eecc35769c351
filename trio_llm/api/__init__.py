"""The HTTP and WebSocket server of the API server process.

Its own modules are what spans the APIs: the ASGI app (`trio_llm.api.app`), which model
answers a request (`trio_llm.api.model_router`) and the routes about the models
(`trio_llm.api.model_cards`), ``/metrics``, vLLM's utility routes, embeddings and the chat
page. Beside them, one package per concern: `trio_llm.api.http` (what every route
shares, the route table), `trio_llm.api.chat` (the one request path every API runs on),
`trio_llm.api.tools`, and one package per API built on chat (`trio_llm.api.anthropic`,
`trio_llm.api.responses`), files and batches (`trio_llm.api.batch`) and the WebSocket
(`trio_llm.api.websocket`).

It talks to the engine core through `trio_llm.frontend`'s engine handle. Nothing is
imported here: import the modules themselves.
"""
