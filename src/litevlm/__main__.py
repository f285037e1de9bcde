"""`python -m litevlm`: the same as the `litevlm` command."""

import sys

from litevlm.cli import main

sys.exit(main())
