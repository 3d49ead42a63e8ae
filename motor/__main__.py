"""``python -m motor`` == the ``motor`` command."""
import sys

from motor.cli import main

sys.exit(main())
