import sys

from kvshard.bench.cli import main

sys.exit(main())
