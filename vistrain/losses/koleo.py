"""The KoLeo regulariser (Sablayrolles et al., 2019) as DINOv2 adds it to the student's class
tokens: "it encourages a uniform span of the features within a batch".

``L = -(1 / n) sum_i log(d_{n,i})`` with ``d_{n,i} = min_{j != i} ||x_i - x_j||`` on the
L2-normalised features of one crop of the batch.

Per rank, as DINOv2: the nearest neighbour is searched among this rank's images only (no
gather), so the value depends on how the global batch is split; each rank's value equals the
single-process value on that rank's images (tested), and DDP or the sharded engine average the
ranks' gradients.
"""

import torch
import torch.nn.functional as F

from vistrain.losses.global_batch import compute_dtype

EPS = 1e-8  # DINOv2's: in the normalisation, the distance and the logarithm


def koleo_loss(features: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """KoLeo of features (n, D), n >= 2, in float32 (float64 for float64 features).

    The nearest neighbour of each row (largest cosine similarity to another row; no gradient
    through the choice), then ``-mean log(||x_i - x_nn(i) + eps|| + eps)`` on the normalised
    rows (``F.pairwise_distance`` adds eps to the difference, as DINOv2's ``PairwiseDistance``).
    """
    if features.dim() != 2 or features.shape[0] < 2:
        raise ValueError(f"koleo needs (n, D) features with n >= 2, got shape {tuple(features.shape)}")
    with torch.autocast(device_type="cpu" if features.is_meta else features.device.type, enabled=False):
        x = F.normalize(features.to(compute_dtype(features)), p=2, dim=-1, eps=eps)
        with torch.no_grad():
            similarity = x @ x.t()
            similarity.fill_diagonal_(-2.0)  # below any cosine: a row is not its own neighbour
            nearest = similarity.argmax(dim=1)
        distances = F.pairwise_distance(x, x[nearest], p=2, eps=eps)
        return -torch.log(distances + eps).mean()
