"""Tool calling on the chat path: the ``--tool-call-parser`` formats (`parsers.py`), the
calls read out of a choice's text (`calls.py`, `call_json.py`) and the grammar that
constrains them (`grammar.py`).
"""
