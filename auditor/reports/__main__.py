"""``python -m auditor.reports …`` (see ``auditor.reports.cli``)."""

import sys

from auditor.reports.cli import main

sys.exit(main())
