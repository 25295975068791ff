#!/usr/bin/env python
"""Run a job (ENGINE_NAME: train, linear_eval, knn, extract_features) on every rank of a job.

    python tools/run_distributed.py config=regnet_fsdp config.OPTIMIZER.num_epochs=2 ...

Exit codes: 0 done, 1 a rank failed (its error is printed), 2 bad config (one line, nothing started).
"""

import sys

from vistrain.config import ConfigError, load_config


def main(argv) -> int:
    try:
        cfg = load_config(argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    # imported once the config is known good: a typo is answered before torch loads
    from vistrain.distributed.launch import RankFailedError, launch
    from vistrain.jobs import get_job

    try:
        launch(get_job(cfg.ENGINE_NAME), cfg)
    except ConfigError as e:  # impossible distributed settings, unknown ENGINE_NAME: nothing started
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except RankFailedError as e:
        print(f"run failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
