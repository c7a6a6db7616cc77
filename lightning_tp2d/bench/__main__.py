import sys

from lightning_tp2d.bench.cli import main

sys.exit(main())
