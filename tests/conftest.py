import os
import sys

# the suite also runs with PYTHONASYNCIODEBUG=1 (style.md); tests must not depend on it
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
