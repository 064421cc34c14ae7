import sys

from clora.cli import main

sys.exit(main())
