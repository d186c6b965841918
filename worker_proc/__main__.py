import sys

from worker_proc.main import main

sys.exit(main())
