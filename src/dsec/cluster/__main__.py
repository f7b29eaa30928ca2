"""``python -m dsec.cluster``: the gateway process (see :mod:`dsec.cluster.server`)."""

import sys

from dsec.cluster.server import main

sys.exit(main())
