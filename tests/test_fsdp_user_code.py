"""A user's own code on the parameters of a sharded model, outside forward, against DDP.

What SSL clients do between steps (lightly's and Lightning's examples): normalise prototype rows
in place under no_grad, keep an EMA teacher by zipping ``parameters()``, drop a layer's gradient
with ``p.grad = None``, scale or clamp gradients, clip the global norm, assign ``p.data``. Each
runs on 2 and 3 gloo ranks, the same loop under DDP (and a plain teacher copy) and under the
engine (a teacher built and wrapped alike), and must give the same losses, norms and weights.
"""

import copy

import pytest
import torch
from fsdp_models import max_rel_diff
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from vistrain.distributed.testing import run_on_ranks
from vistrain.fsdp import auto_wrap, by_class

STEPS = 4
TOL = 1e-5


class Student(nn.Module):
    """A trunk with a larger layer (77k elements: torch's own fp32 norm of one tensor drifts from
    the exact value beyond ~100k, docs/engine.md), a head, and prototypes whose rows the loop
    normalises in place (SwAV's habit)."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(24, 256), nn.ReLU(), nn.Linear(256, 300), nn.ReLU())
        self.head = nn.Linear(300, 16)
        self.prototypes = nn.Linear(16, 11, bias=False)

    def forward(self, x):
        z = nn.functional.normalize(self.head(self.trunk(x)), dim=1)
        return z, self.prototypes(z)


def _batch(step, rank, world, per_rank=6):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(per_rank * world, 24, generator=g)
    return x[rank * per_rank : (rank + 1) * per_rank]


def _models(sharded: bool):
    torch.manual_seed(0)
    student = Student()
    teacher = copy.deepcopy(student).requires_grad_(False)
    if not sharded:
        return DDP(student), teacher
    policy = by_class([nn.Linear])
    return auto_wrap(student, policy), auto_wrap(teacher, policy)


def _client_loop(rank, world, sharded: bool, optimizer_name: str, keep_grads: bool = False):
    """The client's loop; returns losses, clip norms, weights (student, teacher) and names.
    ``keep_grads``: ``zero_grad(set_to_none=False)`` (gradients kept, zeroed in place), and
    some gradients replaced by other tensors between steps."""
    student, teacher = _models(sharded)
    params = list(student.parameters())
    if optimizer_name == "sgd":
        optimizer = torch.optim.SGD(params, lr=0.2, momentum=0.9, weight_decay=1e-3)
    else:
        # eps 1e-6, not 1e-8: an element whose gradient is of the order of eps gets an update of
        # lr * g / (|g| + eps), which amplifies the last bits of g; with 1e-8 the summation order
        # (DDP's all-reduce, our reduce-scatter) moved trunk.2.weight by 1.7e-5 relative on one CPU
        # (AMD EPYC) and under 1e-5 on another; with 1e-6 the two are equal to the bit there
        optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05, eps=1e-6)
    losses, norms = [], []
    inner = student.module  # DDP's module, or the root unit's wrapped module
    for step in range(STEPS):
        with torch.no_grad():  # SwAV: unit-norm prototype rows, in place on the weight
            w = inner.prototypes.weight
            w.div_(w.norm(dim=1, keepdim=True))
            if step == 1:  # plain assignments reach the next forward too
                inner.head.bias.data = inner.head.bias.data * 0.5
                inner.trunk[0].bias.data.copy_(inner.trunk[0].bias.data.clamp(-0.05, 0.05))
        x = _batch(step, rank, world)
        z, scores = student(x)
        with torch.no_grad():
            target, _ = teacher(x)
        loss = (z - target).pow(2).sum(1).mean() - scores.logsumexp(1).mean() * 0.1
        loss.backward()
        if step < 2:  # DINO: the last layer frozen for the first steps
            for p in inner.prototypes.parameters():
                p.grad = None
        inner.head.weight.grad.mul_(0.5)
        inner.head.bias.grad.clamp_(-0.01, 0.01)
        clip = student.clip_grad_norm_ if sharded else torch.nn.utils.clip_grad_norm_
        norms.append(clip(0.5) if sharded else clip(params, 0.5))
        optimizer.step()
        optimizer.zero_grad(set_to_none=not keep_grads)
        if keep_grads and step == 1:  # gradients that no longer view what the last step made
            inner.trunk[0].weight.grad = torch.zeros_like(inner.trunk[0].weight.grad)
            inner.trunk[2].bias.grad.data = torch.zeros_like(inner.trunk[2].bias.grad)
        with torch.no_grad():  # EMA teacher: zip of parameters, no communication
            m = 0.9
            for t, s in zip(teacher.parameters(), student.parameters()):
                if step % 2:  # lightly's update_momentum assigns .data (the last step too)
                    t.data = t.data * m + s.data * (1.0 - m)
                else:
                    t.mul_(m).add_(s.detach(), alpha=1 - m)
        losses.append(loss.detach())
    names = [n for n, _ in student.named_parameters()]
    teacher_state = teacher.state_dict()
    student_state = student.state_dict() if sharded else student.module.state_dict()
    return (
        torch.stack(losses),
        torch.stack([torch.as_tensor(n) for n in norms]),
        student_state,
        teacher_state,
        names,
    )


def _both(rank, world, optimizer_name):
    return [
        (
            _client_loop(rank, world, False, optimizer_name, keep),
            _client_loop(rank, world, True, optimizer_name, keep),
        )
        for keep in (False, True)
    ]


@pytest.mark.parametrize("world,optimizer_name", [(2, "adamw"), (3, "sgd")])
def test_a_clients_own_loop_equals_ddp(world, optimizer_name):
    """In-place row normalisation, ``p.data = ...``, an EMA teacher over ``zip(parameters())``,
    ``p.grad = None``, ``mul_`` / ``clamp_`` of gradients and clipping: same losses, clip norms
    (1e-6 relative), student and teacher weights as DDP, names of the unwrapped model; also with
    gradients kept between steps (``zero_grad(set_to_none=False)``) and some replaced by the
    user (``p.grad = tensor``, ``p.grad.data = tensor``)."""
    for ddp, ours in (pair for rank in run_on_ranks(_both, world, optimizer_name) for pair in rank):
        assert max_rel_diff(ours[0], ddp[0]) < TOL
        assert ((ours[1] - ddp[1]).abs() / ddp[1]).max() < 1e-6, (ours[1], ddp[1])
        assert (ddp[1] > 0.5).any()  # clipping did clip
        assert max_rel_diff(ours[2], ddp[2]) < TOL
        assert max_rel_diff(ours[3], ddp[3]) < TOL
        assert ours[4] == [n.removeprefix("module.") for n in ddp[4]]


def _local_parameters(rank, world):
    """What a user sees of one parameter outside forward: this rank's whole rows, a view of the
    engine's storage (no copy), and no memory beyond the shards."""
    torch.manual_seed(0)
    model = auto_wrap(Student(), by_class([nn.Linear]))
    rows = model.module.trunk[2].weight
    handle = model.module.trunk[2].unit_state.handles[0]
    shard_ptr = handle.shard.data_ptr()
    views = all(
        shard_ptr <= p.data_ptr() < shard_ptr + handle.shard.numel() * 4 or p.numel() == 0
        for p in handle.local_params
    )
    total = sum(p.numel() for p in model.parameters())
    return tuple(rows.shape), views, total


@pytest.mark.parametrize("world", [2, 3])
def test_local_parameters_are_whole_rows_viewing_the_shard(world):
    results = run_on_ranks(_local_parameters, world)
    assert sum(shape[0] for shape, _, _ in results) == 300
    assert all(shape[1:] == (256,) and views for shape, views, _ in results)
    assert sum(total for _, _, total in results) == sum(p.numel() for p in Student().parameters())


class WritesInForward(nn.Module):
    """A root whose forward writes parameters in place between its units, as a LightningModule's
    ``training_step`` does inside the strategy's root forward: an EMA-like scaling of a unit that
    the previous unit has already prefetched, and a decay of the root's own (gathered) parameter
    once it was used (``+`` saves no operand, so DDP allows it too)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(24, 32)
        self.second = nn.Linear(32, 32)
        self.third = nn.Linear(32, 8)
        self.offset = nn.Parameter(torch.randn(8))

    def forward(self, x):
        h = torch.relu(self.first(x))
        with torch.no_grad():
            self.second.weight.mul_(0.9)  # gathered ahead by ``first``'s prefetch already
        h = torch.relu(self.second(h))
        out = self.third(h) + self.offset
        with torch.no_grad():
            self.offset.mul_(0.5)  # the root's own: written into its gathered weights
        return out


def _writes_in_forward(rank, world, sharded):
    torch.manual_seed(0)
    model = WritesInForward()
    model = auto_wrap(model, by_class([nn.Linear])) if sharded else DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        loss = model(_batch(step, rank, world)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), model.state_dict() if sharded else model.module.state_dict()


def _writes_both(rank, world):
    return _writes_in_forward(rank, world, False), _writes_in_forward(rank, world, True)


def test_in_place_writes_between_units_inside_a_forward_equal_ddp():
    """A prefetched unit written before it runs is gathered again; a write into gathered weights
    (the root's own) goes back to the shard at reshard: as DDP, which reads parameters as it runs."""
    for ddp, ours in run_on_ranks(_writes_both, 2):
        assert max_rel_diff(ours[0], ddp[0]) < TOL
        assert max_rel_diff(ours[1], ddp[1]) < TOL


def _wrong_size_data(rank, world):
    torch.manual_seed(0)
    model = auto_wrap(Student(), by_class([nn.Linear]))
    head = model.module.head.weight
    head.data = torch.zeros(head.numel() + 1)  # not this rank's part of it
    try:
        model(_batch(0, rank, world))
    except ValueError as error:
        return str(error)
    return "no error"


def test_assigning_data_of_another_size_is_one_line_naming_the_parameter():
    for message in run_on_ranks(_wrong_size_data, 2):
        assert "parameter head.weight was given" in message and "summon_full_params" in message
        assert "\n" not in message
