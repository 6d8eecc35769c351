"""The one request path, and the core every API is served through: a request's body and
fields, its `Plan` (`planner.py` builds it), running its choices, streaming them and the
formats that write them (chat completions and completions are its own formats; other
APIs translate into a chat completion: `translated.py`). It names no other API.
"""
