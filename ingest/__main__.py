"""`python -m ingest`: one ingest process (the same as `clora ingest`); run several to scale out."""

import sys

from ingest.process import main

sys.exit(main())
