"""Methods other than ``forward`` on sharded units (``vistrain/fsdp/forward_methods.py``).

A masked-autoencoder client calls its encoder and decoder by name, as lightly's MAE and SimMIM
examples do. Registered (by the user in one line, by the wrap policy, or on the unit after
wrapping) those calls gather like ``forward`` and training equals DDP on 2 and 3 gloo ranks;
unregistered, the first operation mixing a shard with an activation stops on one line naming
the registration, while maintenance code that stays on the shards (rows normalised in place)
keeps working.
"""

import pytest
import torch
from fsdp_models import TokenBlock, max_rel_diff
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from vistrain.distributed.testing import run_on_ranks
from vistrain.fsdp import (
    UnregisteredMethodError,
    auto_wrap,
    by_class,
    register_forward_method,
)

STEPS = 3
TOKENS, KEEP, IN, WIDTH = 6, 2, 8, 16


class Encoder(nn.Module):
    """Tokens (N, T, IN) -> (N, 1 + K, WIDTH): embedding, position, the kept tokens, a class
    token, blocks, LayerNorm (what ``encode(images, idx_keep)`` does in an MAE)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(IN, WIDTH)
        self.pos = nn.Parameter(torch.randn(1, TOKENS, WIDTH) * 0.1)
        self.cls = nn.Parameter(torch.randn(1, 1, WIDTH) * 0.1)
        self.blocks = nn.ModuleList([TokenBlock(WIDTH), TokenBlock(WIDTH)])
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, tokens):
        return self.encode(tokens, None)[:, 0]

    def encode(self, tokens, keep):
        x = self.embed(tokens) + self.pos
        if keep is not None:
            x = x.gather(1, keep[..., None].expand(-1, -1, WIDTH))
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def renormalize_(self):
        """Unit rows of the embedding, in place (rows are whole on every rank)."""
        with torch.no_grad():
            w = self.embed.weight
            w.div_(w.norm(dim=1, keepdim=True))


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(WIDTH, 12)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, 12))
        self.predict = nn.Linear(12, IN)

    def decode(self, encoded, keep):
        """Kept tokens back in place, mask tokens elsewhere: (N, T, IN)."""
        x = self.embed(encoded[:, 1:])
        full = self.mask_token.expand(x.shape[0], TOKENS, -1).clone()
        full = full.scatter(1, keep[..., None].expand(-1, -1, x.shape[-1]), x)
        return self.predict(full)


class MaskedClient(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = Encoder()
        self.decoder = Decoder()

    def forward(self, tokens, keep, masked):
        predicted = self.decoder.decode(self.backbone.encode(tokens, keep), keep)
        pick = masked[..., None].expand(-1, -1, IN)
        return (predicted.gather(1, pick) - tokens.gather(1, pick)).pow(2).mean()


def _batch(step, rank, world, per_rank=3):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randn(per_rank * world, TOKENS, IN, generator=g)
    order = torch.rand(per_rank * world, TOKENS, generator=g).argsort(1)
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    return tokens[rows], order[rows, :KEEP], order[rows, KEEP:]


def _wrapped(how: str, reshard: bool = True):
    torch.manual_seed(0)
    client = MaskedClient()
    decoder_options = {}
    if how == "user":
        register_forward_method(client.backbone, "encode")
        register_forward_method(client.decoder, "decode")
    elif how == "policy":
        decoder_options = {"forward_methods": ("decode",)}
        register_forward_method(client.backbone, "encode")
    policy = by_class({TokenBlock: {}, Encoder: {}, Decoder: decoder_options})
    model = auto_wrap(client, policy, reshard_after_forward=reshard)
    if how == "unit":
        register_forward_method(model.module.backbone, "encode")
        register_forward_method(model.module.decoder, "decode")
    return model


def _train(rank, world, how):
    """STEPS steps of AdamW with the in-place renormalisation between them; returns losses,
    the final weights and the encoder's features after training (no_grad, outside a step)."""
    if how == "ddp":
        torch.manual_seed(0)
        model = DDP(MaskedClient())
    elif how == "zero2":  # the weights stay gathered from forward to backward
        model = _wrapped("user", reshard=False)
    else:
        model = _wrapped(how)
    inner = model.module
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        inner.backbone.renormalize_()  # through the unit: guarded, stays on the shards
        loss = model(*_batch(step, rank, world))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    tokens, keep, _ = _batch(STEPS, rank, world)
    with torch.no_grad():
        features = inner.backbone.encode(tokens, keep)
    return torch.stack(losses), model.state_dict() if how != "ddp" else inner.state_dict(), features


def _all_ways(rank, world):
    return {how: _train(rank, world, how) for how in ("ddp", "user", "policy", "unit", "zero2")}


@pytest.mark.parametrize("world", [2, 3])
def test_registered_methods_gather_and_equal_ddp(world):
    torch.manual_seed(0)
    initial = MaskedClient().state_dict()
    for runs in run_on_ranks(_all_ways, world):
        reference = runs.pop("ddp")
        assert max_rel_diff(reference[1]["decoder.mask_token"], initial["decoder.mask_token"]) > 1e-2
        for how, ours in runs.items():
            assert max_rel_diff(ours[0], reference[0]) < 1e-5, how
            assert max_rel_diff(ours[1], reference[1]) < 1e-5, how
            assert max_rel_diff(ours[2], reference[2]) < 1e-5, how


def _unregistered(rank, world):
    model = _wrapped("none")
    try:
        model(*_batch(0, rank, world))
    except UnregisteredMethodError as error:
        return str(error)
    return "no error"


def test_an_unregistered_method_on_shards_is_one_line_naming_the_registration():
    for message in run_on_ranks(_unregistered, 2):
        assert "\n" not in message
        assert message.startswith("Encoder.encode() computed with this rank's shard of backbone.")
        assert 'vistrain.fsdp.register_forward_method(module, "encode")' in message
        assert 'forward_methods=("encode",)' in message


def test_registration_refuses_what_it_cannot_gather():
    encoder = Encoder()
    with pytest.raises(ValueError, match="Encoder has no method 'encoded'"):
        register_forward_method(encoder, "encoded")
    with pytest.raises(ValueError, match="forward gathers without registration"):
        register_forward_method(encoder, "forward")
