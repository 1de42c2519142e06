import sys

from vllm_ir.tools.cli import main

sys.exit(main())
