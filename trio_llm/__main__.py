"""``python -m trio_llm ...`` is the ``trio-llm`` command."""

from trio_llm.cli.main import main

main()
