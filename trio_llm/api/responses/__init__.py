"""OpenAI's Responses API: its request (`request.py`) translated into a chat completion, its
tools, its output format (`format.py`), stored and background responses and the
Conversations API.
"""
