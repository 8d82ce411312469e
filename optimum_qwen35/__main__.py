import sys

from optimum_qwen35.cli import main

sys.exit(main())
