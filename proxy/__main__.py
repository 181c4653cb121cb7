"""`python -m proxy` is the same as `streamwarden`."""

import sys

from .cli import main

sys.exit(main())
