"""The classic weight-space FGM / PGD recipes, written out as the popular implementations do them: the references
the adversarial tests (test_adversarial, test_causal_lm, test_peft, test_neftune) compare against."""

import torch


def classic_fgm(model, loss_fn, weight, epsilon):
    """Perturb the embedding weight by eps * g / ||g||, forward/backward again, restore the weight."""
    loss_fn().backward()
    backup = weight.data.clone()
    norm = torch.norm(weight.grad)
    if norm != 0 and not torch.isnan(norm):
        weight.data.add_(epsilon * weight.grad / norm)
    loss_fn().backward()
    weight.data = backup


def classic_pgd(model, loss_fn, weight, epsilon, alpha, steps):
    """K weight-space steps from the clean gradient with projection; zero grads between, restore them for the last."""
    loss_fn().backward()
    emb_backup = weight.data.clone()
    grad_backup = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for t in range(steps):
        norm = torch.norm(weight.grad)
        if norm != 0 and not torch.isnan(norm):
            weight.data.add_(alpha * weight.grad / norm)
            r = weight.data - emb_backup
            if torch.norm(r) > epsilon:
                r = epsilon * r / torch.norm(r)
            weight.data = emb_backup + r
        if t != steps - 1:
            model.zero_grad()
        else:
            for n, p in model.named_parameters():
                if n in grad_backup:
                    p.grad = grad_backup[n]
        loss_fn().backward()
    weight.data = emb_backup
