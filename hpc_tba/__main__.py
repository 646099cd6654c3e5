"""`python -m hpc_tba` = `hpc-tba` (with no arguments: train the embedded default)."""
import sys

from hpc_tba.cli.main import main

sys.exit(main())
