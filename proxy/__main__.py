"""`python -m proxy` is the same as `streamwarden`."""

import sys

from proxy.cli import main

sys.exit(main())
