"""``python -m trio_llm.engine.kernels``: build this machine's native kernels."""

import sys

from trio_llm.engine.kernels import main

sys.exit(main())
