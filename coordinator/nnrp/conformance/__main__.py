"""``python -m coordinator.nnrp.conformance --url ws://HOST:PORT/nnrp/v1``: see ``runner``."""

import sys

from coordinator.nnrp.conformance.runner import main

sys.exit(main())
