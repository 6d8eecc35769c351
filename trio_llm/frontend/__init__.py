"""The API server's side of the engine: the handle on the engine-core children.

- `engine_process`: spawns and supervises the engine-core child (and the detokenizer
  child of 3-process mode), restarting failed ones; only it starts children
  (`child_process`: one child, spawned from the Trio thread and awaited via a pidfd).
- `engine_client`: `EngineClient`, one engine's requests over its IPC channel, with
  `request_stream` (each request's mailbox and stream), `admission` (the waiting line,
  draining), `liveness` (heartbeats, health checks, hangs) and `request_timing`.
- `data_parallel`: `DataParallelClient`, N engines behind one handle; `handle`: the
  `EngineHandle` protocol both implement, what the request path uses.
- `preprocess`, `generation_defaults`: prompts to token ids and sampling parameters
  before a request goes to the engine.
"""
