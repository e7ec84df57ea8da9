"""``python -m jobs.dev.simulator``: the same as ``llmstream model-server`` (``spawn`` runs it)."""

import sys

from jobs.dev.simulator.cli import main

sys.exit(main())
