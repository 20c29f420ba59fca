import sys

from fnmoe.cli import main

sys.exit(main())
