"""Prints the monitor's kNN top-1 (the knn job on the monitor's config) of a ViT demo's trunk on its
class token ("cls") and its mean patch token ("avgpool"), untrained and at each checkpoint given:
which of the two a sequence-reading demo's monitor should watch.

    python dev/studies/monitor_vit_features.py --config pretrain/dinov2_vit_demo [CHECKPOINT ...]

The untrained trunk is the one a fresh run of the config starts from (the same seed); one process.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from vistrain.benchmarks.knn import knn  # noqa: E402
from vistrain.distributed.testing import run_on_ranks  # noqa: E402
from vistrain.methods import load_config  # noqa: E402
from vistrain.training.monitor import knn_config  # noqa: E402

FEATURES = ["cls", "avgpool"]


def _knn_on_rank(rank, world_size, config: str, weights: str, out_dir: str):
    cfg = knn_config(load_config([f"config={config}", "config.MONITOR.EVERY_EPOCHS=1"]))
    cfg.defrost()
    cfg.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP = False
    cfg.BENCHMARK.FEATURES = FEATURES
    cfg.MODEL.WEIGHTS_INIT.PARAMS_FILE = weights
    cfg.MODEL.WEIGHTS_INIT.SKIP_LAYERS = ["head."]
    cfg.CHECKPOINT.DIR = out_dir
    cfg.freeze()
    knn(cfg)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="pretrain/dinov2_vit_demo")
    parser.add_argument("checkpoints", nargs="*", help="checkpoint files or run folders")
    args = parser.parse_args()
    for weights in ["", *args.checkpoints]:
        with tempfile.TemporaryDirectory() as tmp:
            run_on_ranks(_knn_on_rank, 1, args.config, weights, tmp)
            results = json.loads((Path(tmp) / "metrics.json").read_text())["results"]
        line = ", ".join(f"{name} {results[name]['top1']:.2f}%" for name in FEATURES)
        print(f"{args.config} {weights or 'untrained'}: {line}", flush=True)


if __name__ == "__main__":
    main()
