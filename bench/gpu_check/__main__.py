import sys

from bench.gpu_check.cli import main

sys.exit(main())
