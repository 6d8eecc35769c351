"""What every HTTP route shares: OpenAI-style errors, parsing a body into a request model,
reading the body, disconnects, lanes, the operator middleware, the connection guard, the
access log, the route table (`routes.py`) and what every route of stored objects shares
(`store_routes.py`).
"""
