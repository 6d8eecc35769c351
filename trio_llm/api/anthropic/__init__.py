"""The Anthropic Messages API (``POST /v1/messages`` and ``/v1/messages/count_tokens``): its
request (`request.py`) translated into a chat completion, its conversation blocks, context
editing, and its output format (`format.py`).
"""
