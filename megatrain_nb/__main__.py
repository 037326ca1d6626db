"""``python -m megatrain_nb {demo,train}``; the ``megatrain-nb`` script also enters here (see cli.py)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
