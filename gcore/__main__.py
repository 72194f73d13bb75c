import sys

from gcore.cli import main

sys.exit(main())
