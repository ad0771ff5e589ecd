"""`python -m common.miniatures KIND [OUT_DIR]`: write a miniature target (see targets.py)."""
import sys

from common.miniatures.targets import main

sys.exit(main())
