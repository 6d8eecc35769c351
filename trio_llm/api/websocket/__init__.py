"""WebSocket token streaming (``/v1/ws``, docs/websocket.md): the connection's handler
(`handler.py`), its handshake checks and its messages.
"""
