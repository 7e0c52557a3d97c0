"""`ray job submit ... -- python -m jobs.fit [--config FILE] [--section.key VALUE ...]`: `python -m pipeline fit`."""

import sys

from pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main(["fit", *sys.argv[1:]]))
