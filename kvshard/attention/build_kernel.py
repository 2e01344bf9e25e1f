"""`python -m kvshard.attention.build_kernel`: build the paged attention kernel now, as `make install` does,
rather than in the first engine that starts (attention/paged.py); nothing to do where it is built already."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from kvshard.attention import paged


def main(argv: Sequence[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m kvshard.attention.build_kernel", description=__doc__).parse_args(argv)
    start = time.perf_counter()
    if paged.load_extension() is None:  # not an error: engines run the gather path without it
        print(f"kvshard: the paged attention kernel is unavailable: {paged.unavailable_reason()}; attention "
              "will use the gather path", file=sys.stderr)
        return 0
    print(f"kvshard: paged attention kernel ready in {paged.kernel_cache_dir()} "
          f"({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
