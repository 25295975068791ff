"""SwAV training steps against an independent, plain re-statement of the paper's algorithm.

The reference below follows Algorithm 1 of Caron et al. (2020) and the training loop of the
authors' ``main_swav.py``, written out step by step in float64 with no vistrain code except the
head's initial weights: normalise the prototypes, embed and L2-normalise every crop, score
against the prototypes, Sinkhorn codes of the assign crops over [queue scores (current
prototypes); batch scores], swapped prediction, then drop the prototypes' gradient during the
first ``freeze`` iterations and take an SGD step. Our SwAVHead + SwAVCriterion + torch SGD run the
same steps; losses and every weight must agree to float64 rounding. This pins down the places
where SwAV implementations usually go wrong: prototypes normalised before scoring, the queue
scored with the current prototypes, which iterations drop the prototype gradient, temperature
(predictions) vs epsilon (codes), the queue's order and when it starts to be used.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from vistrain.methods import build_loss, get_defaults
from vistrain.methods.swav import SwAVHead

TEMPERATURE, EPSILON, ITERS = 0.1, 0.05, 3
BATCH, NUM_CROPS, ASSIGN = 4, 4, [0, 1]


def reference_sinkhorn(scores, epsilon, iterations):
    """Algorithm 1's ``sinkhorn``: scores (B, K) -> codes (B, K), each row summing to 1."""
    q = torch.exp(scores / epsilon).t()
    q = q / q.sum()
    k, b = q.shape
    r, c = torch.ones(k, dtype=q.dtype) / k, torch.ones(b, dtype=q.dtype) / b
    for _ in range(iterations):
        q = q * (r / q.sum(dim=1)).unsqueeze(1)
        q = q * (c / q.sum(dim=0)).unsqueeze(0)
    return (q / q.sum(dim=0, keepdim=True)).t()


def reference_step(params, crops, queue, state, lr, freeze):
    """One training iteration of main_swav.py on a head Linear -> ReLU -> Linear -> normalize -> C."""
    w1, b1, w2, b2, protos = (p.detach().requires_grad_() for p in params)
    with torch.no_grad():  # "normalize the prototypes" at the start of every iteration
        protos.copy_(F.normalize(protos, dim=1))
    x = torch.cat(crops)
    embedding = F.normalize(F.relu(x @ w1.t() + b1) @ w2.t() + b2, dim=1)
    output = embedding @ protos.t()
    loss = 0.0
    for i, crop_id in enumerate(ASSIGN):
        with torch.no_grad():
            out = output[BATCH * crop_id : BATCH * (crop_id + 1)].detach()
            if queue is not None:
                if state["use_queue"] or bool(torch.any(queue[i, -1] != 0)):
                    state["use_queue"] = True
                    out = torch.cat([queue[i] @ protos.t(), out])
                queue[i, BATCH:] = queue[i, :-BATCH].clone()
                queue[i, :BATCH] = embedding[BATCH * crop_id : BATCH * (crop_id + 1)]
            q = reference_sinkhorn(out, EPSILON, ITERS)[-BATCH:]
        subloss = 0.0
        for v in [v for v in range(NUM_CROPS) if v != crop_id]:
            logits = output[BATCH * v : BATCH * (v + 1)] / TEMPERATURE
            subloss = subloss - torch.mean(torch.sum(q * F.log_softmax(logits, dim=1), dim=1))
        loss = loss + subloss / (NUM_CROPS - 1)
    loss = loss / len(ASSIGN)
    loss.backward()
    if state["iteration"] < freeze:
        protos.grad = None
    state["iteration"] += 1
    with torch.no_grad():
        updated = [p - lr * p.grad if p.grad is not None else p.clone() for p in (w1, b1, w2, b2, protos)]
    return [p.detach() for p in updated], loss.detach()


def _criterion(freeze, queue_length):
    cfg = get_defaults().LOSS
    cfg.NAME = "swav_loss"
    cfg.swav_loss.update(
        temperature=TEMPERATURE,
        epsilon=EPSILON,
        sinkhorn_iterations=ITERS,
        crops_for_assign=ASSIGN,
        freeze_prototypes_niters=freeze,
        queue_length=queue_length,
        start_queue_at_epoch=0,
    )
    return build_loss(cfg)


@pytest.mark.parametrize("queue_length", [0, 2 * BATCH])
def test_swav_training_steps_equal_the_papers_algorithm(queue_length):
    freeze, lr, steps = 2, 0.5, 6
    torch.manual_seed(0)
    head = SwAVHead([6, 16, 5], use_bn=False, nmb_prototypes=[7]).double()
    with torch.no_grad():  # prototypes off the sphere: only normalisation before scoring brings them back
        head.prototypes[0].weight.mul_(torch.linspace(0.5, 2.0, 7, dtype=torch.float64).unsqueeze(1))
    first, second = head.projection.layers[0], head.projection.layers[2]
    params = [copy.deepcopy(t.detach()) for t in (first.weight, first.bias, second.weight, second.bias)]
    params.append(head.prototypes[0].weight.detach().clone())
    head.normalize_prototypes()  # ours normalises after every step; the reference before every step
    initial = head.prototypes[0].weight.detach().clone()

    criterion = _criterion(freeze, queue_length)
    criterion.set_epoch(0)
    optimizer = torch.optim.SGD(head.parameters(), lr=lr)
    queue = torch.zeros(len(ASSIGN), queue_length, 5, dtype=torch.float64) if queue_length else None
    state = {"use_queue": False, "iteration": 0}
    generator = torch.Generator().manual_seed(1)
    for iteration in range(steps):
        crops = [torch.randn(BATCH, 6, generator=generator, dtype=torch.float64) for _ in range(NUM_CROPS)]
        params, expected = reference_step(params, crops, queue, state, lr, freeze)

        optimizer.zero_grad()
        loss = criterion(head(torch.cat(crops)), num_crops=NUM_CROPS)
        loss.backward()
        criterion.before_optimizer_step(head, iteration)
        optimizer.step()
        criterion.after_optimizer_step(head)

        torch.testing.assert_close(
            loss.detach(), expected, rtol=1e-12, atol=1e-12, msg=f"loss, step {iteration}"
        )
        mine = [first.weight, first.bias, second.weight, second.bias]
        for name, ours, theirs in zip(["w1", "b1", "w2", "b2"], mine, params[:4]):
            torch.testing.assert_close(
                ours.detach(), theirs, rtol=1e-10, atol=1e-12, msg=f"{name}, step {iteration}"
            )
        # ours stores the normalised prototypes, the reference normalises them at its next step
        torch.testing.assert_close(
            head.prototypes[0].weight.detach(), F.normalize(params[4], dim=1), rtol=1e-10, atol=1e-12
        )
        if iteration < freeze:  # frozen: the prototypes have not moved since initialisation
            torch.testing.assert_close(head.prototypes[0].weight.detach(), initial, rtol=0, atol=1e-15)
    if queue_length:
        assert state["use_queue"]  # the queue took part in the last steps
        torch.testing.assert_close(criterion.loss.queue, queue, rtol=1e-12, atol=1e-12)
