import sys

from hpc.cli.main import main

sys.exit(main())
