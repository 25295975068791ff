"""Look at a trained trunk: pictures of what it learned, each from one command on a run folder.

    python tools/look.py RUN_FOLDER [map] [neighbours] [attention] [duplicates] [--data train|test|FOLDER]
                         [config.LOOK.KEY=VALUE ...]

(none named: all four). The run's resolved config and latest checkpoint are read
(:mod:`.sample`); the images are embedded once, in one process; each picture goes to
``LOOK.OUTPUT_DIR`` (default ``RUN_FOLDER/look``) as a PNG and to the run's TensorBoard as the
image ``look/<name>`` at the checkpoint's iteration:

=============  =================================================================================
``map``        ``map.png``: PCA and t-SNE maps of the embeddings with thumbnails (:mod:`.maps`)
``neighbours`` ``neighbours.png``: query images and their nearest neighbours (:mod:`.sheets`)
``attention``  ``attention.png``: a ViT's class-token attention per head, a CNN's feature norm
               per location (:mod:`.attention`)
``duplicates`` ``duplicates.png``, ``duplicates.csv``, ``outliers.csv``: near-duplicate pairs and
               outliers by cosine similarity (:mod:`.sheets`)
=============  =================================================================================

The knobs are the config's ``LOOK`` section (``vistrain/config/defaults.py``): the sample cap
``MAX_IMAGES`` (t-SNE and the pair search grow as its square), the duplicate threshold, the
numbers of queries, neighbours, images and thumbnails.
"""

import os
from typing import Callable, Dict, List, Sequence

from vistrain.benchmarks.look import attention, maps, sheets
from vistrain.benchmarks.look.sample import checkpoint_iteration, device_of, embed, maps_drawn, run_config
from vistrain.models.trunks import token_layout
from vistrain.runtime.logger import logger, setup_logging
from vistrain.runtime.pictures import save_picture

# picture name -> draw(look) -> (image, one-line description); ``look`` holds cfg, sample, trunk...
PICTURES: Dict[str, Callable] = {
    "map": lambda look: maps.draw(look.sample, look.cfg),
    "neighbours": lambda look: sheets.neighbours(look.sample, look.cfg),
    "attention": lambda look: attention.draw(
        look.trunk, look.sample, token_layout(look.cfg.MODEL.TRUNK), look.spatial, look.cfg, look.device
    ),
    "duplicates": lambda look: sheets.duplicates(look.sample, look.cfg, look.out_dir),
}


class Look:
    """One look at a run: its config (:func:`.sample.run_config`), the frozen trunk on one device,
    the embedded sample, where the pictures go."""

    def __init__(self, cfg):
        from vistrain.benchmarks import common

        self.cfg, self.spatial = cfg, maps_drawn(cfg.MODEL)
        self.out_dir = cfg.LOOK.OUTPUT_DIR or os.path.join(cfg.CHECKPOINT.DIR, "look")
        setup_logging(self.out_dir)
        self.device = device_of(cfg)
        self.trunk, _ = common.build_frozen_trunk(cfg, self.device)
        self.step = checkpoint_iteration(cfg)
        self.sample = embed(cfg, self.trunk, self.device)

    def draw(self, names: Sequence[str], writer=None) -> List[str]:
        """Draw each picture of ``names``; returns the paths of the PNGs written."""
        paths = []
        for name in names:
            image, what = PICTURES[name](self)
            paths.append(save_picture(image, self.out_dir, f"{name}.png", writer, f"look/{name}", self.step))
            logger.info(f"wrote {paths[-1]} ({what}; {image.width} x {image.height} px)")
        return paths


__all__ = ["PICTURES", "Look", "run_config"]
