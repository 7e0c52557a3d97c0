"""`ray job submit ... -- python -m jobs.train [--config FILE] [--section.key VALUE ...]`: `python -m pipeline train`."""

import sys

from pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
