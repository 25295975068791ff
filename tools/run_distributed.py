#!/usr/bin/env python
"""Run a job (JOB: train, linear_eval, knn, extract_features) on every rank of a job.

    python tools/run_distributed.py config=regnet_fsdp config.OPTIMIZER.num_epochs=2 ...

Exit codes (vistrain/cli.py): 0 done, 1 a rank failed (its error is printed), 2 refused before
anything started (bad config, run folder in use; one line), 130 interrupted (Ctrl-C; one line).
"""

import sys

from vistrain.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
