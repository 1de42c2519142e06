import sys

from vllm_ir.cli import main

sys.exit(main())
