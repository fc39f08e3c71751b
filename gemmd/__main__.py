import sys

from gemmd.cli import main

sys.exit(main())
