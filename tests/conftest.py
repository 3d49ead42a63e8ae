import os
import sys

# .ci/run runs the suite twice, the second time under PYTHONASYNCIODEBUG=1; tests must not
# depend on it
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
