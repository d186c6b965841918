import gc
import sys

# torch's import builds a few hundred thousand objects that live as long as the process:
# collecting while it runs only walks them again and again (pegainfer/gc_control.py).
gc.disable()

from worker_proc.main import main  # noqa: E402

sys.exit(main())
