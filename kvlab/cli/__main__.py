"""``python -m kvlab.cli``, the same as ``kvlab`` (and ``python -m kvlab``)."""

import sys

from kvlab.cli import main

sys.exit(main())
