"""The command line: ``trio-llm`` and its subcommands (`main.py`), the ``serve`` flags table
(`serve_flags.py`) and the argument types (`types.py`).
"""
