"""`python -m spillway.sidecar.cli`: the `spillway` command."""

import sys

from spillway.sidecar.cli.main import main

sys.exit(main())
