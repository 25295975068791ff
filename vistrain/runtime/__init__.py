"""What every job needs on a rank: the run's start (logging, saved config, seed, device), log lines
and meters, and turning a plain model into this rank's data-parallel one (DDP or sharded)."""
