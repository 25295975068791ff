"""A checkpoint's first convolution loaded into a trunk taking other input channels
(``MODEL.TRUNK.IN_CHANNELS``): 3-channel public weights on grey or multi-band images, adapted as
timm adapts them when it builds a model with another ``in_chans``
(``timm.models._manipulate.adapt_input_conv``).

Only the model's first ``nn.Conv2d`` (in module order: the stem, or a ViT's patch projection) is
adapted, and only when its kernels differ from the checkpoint's in the input channels alone; any
other shape mismatch stays an error.
"""

from typing import Optional, Sequence

import torch
from torch import nn


def first_conv_weight(model: nn.Module) -> Optional[str]:
    """The state-dict name of the weight of ``model``'s first ``nn.Conv2d``; None without one."""
    name = next((n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)), None)
    return None if name is None else f"{name}.weight" if name else "weight"


def adaptable(saved: Sequence[int], wanted: Sequence[int]) -> bool:
    """Whether 3-channel kernels of shape ``saved`` (O, 3, kh, kw) can become ``wanted``
    (O, C, kh, kw), C != 3, by :func:`adapt_input_conv`."""
    if len(saved) != 4 or len(wanted) != 4 or saved[1] != 3 or wanted[1] == 3:
        return False
    return (saved[0], *saved[2:]) == (wanted[0], *wanted[2:])


def adapt_input_conv(weight: torch.Tensor, channels: int) -> torch.Tensor:
    """RGB kernels (O, 3, kh, kw) -> (O, ``channels``, kh, kw), computed in float32, returned in
    ``weight``'s dtype:

    * ``channels`` 1: each kernel summed over its three inputs, so a grey image x gives what the RGB
      kernels gave on (x, x, x);
    * ``channels`` C > 1: input c takes the kernel of RGB input c mod 3, all scaled by 3 / C (for
      C a multiple of 3, an image of C equal channels gives what the RGB kernels gave).
    """
    out, inputs, kh, kw = weight.shape
    if inputs != 3:
        raise ValueError(f"cannot adapt kernels of {inputs} input channels (only RGB ones) to {channels}")
    kernels = weight.float()
    if channels == 1:
        kernels = kernels.sum(1, keepdim=True)
    else:
        kernels = kernels[:, torch.arange(channels) % 3] * (3 / channels)
    return kernels.to(weight.dtype)
