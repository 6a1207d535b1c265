"""`python -m llmplan`: the `llmplan` command (same entry point, same Ctrl-C handling)."""

import sys

from llmplan.engine.entry import main

sys.exit(main())
