import sys

from pipeplan.cli import main

sys.exit(main())
