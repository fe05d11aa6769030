"""``python -m auditor …`` (see ``auditor.cli``)."""

import sys

from auditor.cli import main

sys.exit(main())
