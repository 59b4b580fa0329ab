"""Adversarial training in embedding space: FGM and PGD on the output of the word-embedding module.

The classic recipe perturbs the word-embedding *weight* by ``r = eps * g / ||g||`` (``g`` its gradient), runs the
model again and restores the weight; the update uses the sum of the clean and the adversarial gradients. Here the
perturbation is added to the embedding module's *output* through a forward hook instead:

- nothing vocab-sized is copied: the weight-equivalent ("global") perturbation is a scatter over the batch's token
  ids (the weight gradient's row for id ``v`` is the sum of the output gradients at the positions holding ``v``), so
  its cost grows with the batch's tokens, not with the vocabulary;
- the gradient comes from the embedding output of the current call only, never from ``weight.grad`` (which holds the
  gradients accumulated over earlier micro-batches), and frozen embeddings (LoRA / PEFT) are attacked all the same;
- with input and output embeddings tied, only the input side is perturbed;
- no parameter gradient is backed up: PGD's intermediate passes take ``torch.autograd.grad`` with respect to the
  perturbation only, which also skips every weight-gradient product;
- the adversarial backward adds its word-embedding gradient to ``weight.grad`` as a sparse tensor (the rows the
  batch used), where the stock embedding backward would build and add another dense vocab x dim gradient: the
  attack's cost does not grow with the vocabulary.

Two relatives live here too: :class:`FreeLB` (K ascent steps on the same hook, every pass's parameter gradient kept)
and :class:`AWP` (a perturbation of the weights of the transformer layers instead of the embeddings).

These classes know nothing of the Trainer; :class:`~nlp_tricks.TricksTrainer` wires them in with
``--adversarial fgm|pgd|awp|freelb``.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import torch
from torch import nn

__all__ = [
    "FGM",
    "PGD",
    "FreeLB",
    "AWP",
    "ADV_NORMS",
    "resolve_embedding_module",
    "awp_parameters",
    "validate_attack",
    "validate_freelb",
    "validate_awp",
]

ADV_NORMS = ("global", "example", "token")


def validate_attack(
    epsilon: float,
    alpha: float,
    steps: int,
    norm: str,
    names=("epsilon", "alpha", "steps", "norm"),
    *,
    epsilon_may_be_zero: bool = False,
) -> None:
    """Raise ``ValueError`` naming the argument (``names``: what the caller calls them) for an invalid attack.
    ``epsilon_may_be_zero``: FreeLB's radius, where 0 means no projection."""
    eps_name, alpha_name, steps_name, norm_name = names
    if epsilon_may_be_zero and not epsilon >= 0:
        raise ValueError(f"{eps_name}={epsilon} is not allowed; it must be >= 0 (0: no projection)")
    if not epsilon_may_be_zero and not epsilon > 0:
        raise ValueError(f"{eps_name}={epsilon} is not allowed; it must be > 0")
    if not alpha > 0:
        raise ValueError(f"{alpha_name}={alpha} is not allowed; it must be > 0")
    if int(steps) != steps or steps < 1:
        raise ValueError(f"{steps_name}={steps} is not allowed; it must be an integer >= 1")
    if norm not in ADV_NORMS:
        raise ValueError(f"{norm_name}={norm!r} is not allowed; choose one of {', '.join(map(repr, ADV_NORMS))}")


def validate_freelb(init_mag: float, name: str = "init_mag") -> None:
    """FreeLB's own argument beside :func:`validate_attack`'s: the random start's magnitude, >= 0."""
    if not init_mag >= 0:
        raise ValueError(f"{name}={init_mag} is not allowed; it must be >= 0 (0: start at zero)")


def validate_awp(gamma: float, target: str | None, names=("gamma", "target")) -> None:
    """Raise ``ValueError`` naming the argument for an invalid AWP size or target regular expression."""
    gamma_name, target_name = names
    if not gamma > 0:
        raise ValueError(f"{gamma_name}={gamma} is not allowed; it must be > 0")
    if target is not None:
        try:
            re.compile(target)
        except re.error as err:
            raise ValueError(f"{target_name}={target!r} is not a valid regular expression: {err}") from None


def resolve_embedding_module(model: nn.Module, target: str | None = None) -> nn.Module:
    """The module whose output is perturbed: ``model.get_input_embeddings()``, or the module named ``target``.

    ``target`` is a full module name (``bert.embeddings.word_embeddings``) or a unique suffix of one
    (``word_embeddings``).
    """
    if target is None:
        if hasattr(model, "get_input_embeddings"):
            return model.get_input_embeddings()
        # A wrapper around one transformers model (a SentenceTransformer): that model's input embeddings.
        inner = [m for m in model.modules() if m is not model and hasattr(m, "get_input_embeddings")]
        outermost = [m for m in inner if not any(m is not o and m in set(o.modules()) for o in inner)]
        if len(outermost) == 1:
            return outermost[0].get_input_embeddings()
        raise ValueError(
            f"{type(model).__name__} has no get_input_embeddings(); name the module to attack with target= "
            "(adv_target), e.g. 'word_embeddings'"
        )
    modules = dict(model.named_modules())
    if target in modules:
        return modules[target]
    matches = [name for name in modules if name.endswith("." + target)]
    if len(matches) == 1:
        return modules[matches[0]]
    if not matches:
        raise ValueError(f"adv_target={target!r} names no module of {type(model).__name__}")
    raise ValueError(f"adv_target={target!r} is ambiguous in {type(model).__name__}; give one of {matches}")


def _modules_sharing_weight(model: nn.Module, module: nn.Module) -> list[nn.Module]:
    """``module`` and the other embedding modules that look up the same weight (e.g. an encoder's and a decoder's
    ``embed_tokens`` tied to ``shared``), whose outputs the weight-space recipe would perturb too. Output
    projections tied to it (``lm_head``) are not embeddings and are left alone."""
    weight = getattr(module, "weight", None)
    found = [module]
    if not isinstance(weight, nn.Parameter):
        return found
    for other in model.modules():
        if other is not module and getattr(other, "weight", None) is weight:
            if isinstance(other, nn.Embedding) or type(other) is type(module):
                found.append(other)
    return found


class _SparseWeightGrad(torch.autograd.Function):
    """``F.embedding(ids, weight)`` whose backward gives the weight a sparse gradient: the looked-up rows only.

    Used in the adversarial pass when ``weight.grad`` already holds the clean dense gradient: autograd then adds
    the sparse rows into it in place (O(batch tokens x dim)), the same sum the stock backward makes by building a
    dense vocab x dim gradient first. Parameter hooks (DDP's all-reduce) fire as usual and see the dense sum.
    """

    @staticmethod
    def forward(ctx, weight, ids, padding_idx):
        ctx.save_for_backward(ids)
        ctx.weight_shape = weight.shape
        ctx.padding_idx = padding_idx
        return nn.functional.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_output):
        (ids,) = ctx.saved_tensors
        ids = ids.reshape(-1)
        rows = grad_output.reshape(ids.numel(), -1)
        if ctx.padding_idx is not None:  # as the stock backward: the padding row gets no gradient
            rows = rows.masked_fill((ids == ctx.padding_idx).unsqueeze(-1), 0)
        grad = torch.sparse_coo_tensor(ids.unsqueeze(0), rows, ctx.weight_shape, check_invariants=False)
        return grad, None, None


def _sparse_grad_ok(module: nn.Module) -> bool:
    """Whether the adversarial pass may route ``module``'s weight gradient through :class:`_SparseWeightGrad`: a plain
    ``nn.Embedding`` lookup into a leaf weight whose ``.grad`` is a dense tensor already (so the sum stays dense).
    Anything else (scaled or subclassed embeddings, max_norm, DataParallel replicas, FSDP / ZeRO parameters whose
    ``.grad`` lives elsewhere) keeps the stock backward."""
    weight = getattr(module, "weight", None)
    return (
        type(module).forward is nn.Embedding.forward
        and isinstance(weight, nn.Parameter)
        and weight.is_leaf
        and weight.requires_grad
        and weight.grad is not None
        and weight.grad.layout == torch.strided
        and not weight.grad.requires_grad
        and module.max_norm is None
        and not module.scale_grad_by_freq
        and not module.sparse
    )


def _lookup_ids(args: tuple, output: torch.Tensor) -> torch.Tensor | None:
    """The token ids the embedding call looked up (its first argument), or None when it was not an id lookup."""
    ids = args[0] if args and torch.is_tensor(args[0]) else None
    if ids is None or ids.is_floating_point() or ids.shape != output.shape[:-1]:
        return None
    return ids


@dataclass
class _Call:
    """One call of the embedding module in a forward pass: where its positions sit in the flattened batch."""

    device: torch.device
    dtype: torch.dtype
    shape: torch.Size
    start: int
    end: int


class _Space:
    """The perturbation's coordinates for one batch and the maps between them and the embedding outputs.

    A perturbation ``P`` has shape ``(rows, hidden)``. For the "global" norm on an id lookup the rows are the batch's
    distinct token ids (the rows of the weight the batch uses): a position's perturbation is its id's row. Otherwise
    a row is a position. ``group`` assigns rows to the sets normalised together (all, one per example, one per row).
    """

    def __init__(self, calls, ids, grads, padding_idx, norm):
        self.calls = calls
        self.norm = norm
        self.keep = None
        if ids is not None and padding_idx is not None:
            # The weight's padding row never receives a gradient, so the classic recipe never perturbs it.
            self.keep = (ids != padding_idx).unsqueeze(-1).to(grads.dtype)
        self.inverse = None
        if norm == "global" and ids is not None:
            unique, self.inverse = torch.unique(ids, return_inverse=True)
            self.rows = unique.numel()
        else:
            self.rows = grads.shape[0]
        device = grads.device
        if norm == "global":
            self.group = torch.zeros(self.rows, dtype=torch.long, device=device)
        elif norm == "token":
            self.group = torch.arange(self.rows, device=device)
        else:
            groups, offset = [], 0
            for call in calls:
                n = call.end - call.start
                examples = call.shape[0] if len(call.shape) >= 3 else n
                groups.append(offset + torch.arange(n, device=device) // (n // examples))
                offset += examples
            self.group = torch.cat(groups)
        self.clean_grad = self.to_rows(grads)

    def to_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Gradients at the positions -> gradient of the rows (a sum over the positions sharing an id)."""
        if self.keep is not None:
            positions = positions * self.keep
        if self.inverse is None:
            return positions
        rows = positions.new_zeros(self.rows, positions.shape[-1])
        return rows.index_add_(0, self.inverse, positions)

    def to_outputs(self, rows: torch.Tensor) -> dict[torch.device, list[torch.Tensor]]:
        """A perturbation of the rows -> the tensor to add to each embedding call's output, by device."""
        positions = rows if self.inverse is None else rows[self.inverse]
        if self.keep is not None:
            positions = positions * self.keep
        out: dict[torch.device, list[torch.Tensor]] = {}
        for call in self.calls:
            r = positions[call.start : call.end].reshape(call.shape).to(device=call.device, dtype=call.dtype)
            out.setdefault(call.device, []).append(r)
        return out

    def row_norms(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The L2 norm of each row's group (broadcast to the rows) and the norm of everything."""
        squares = rows.pow(2).sum(-1)
        total = squares.sum().sqrt()
        if self.norm == "global":
            return total.expand(self.rows), total
        if self.norm == "token":
            return squares.sqrt(), total
        per_group = squares.new_zeros(int(self.group[-1]) + 1).index_add_(0, self.group, squares)
        return per_group.sqrt()[self.group], total


def embedding_modules(model: nn.Module, target: str | None = None) -> tuple[nn.Module, list[nn.Module]]:
    """The module an embedding-space method perturbs (:func:`resolve_embedding_module`) and every embedding module
    that looks up the same weight (itself first)."""
    module = resolve_embedding_module(model, target)
    return module, _modules_sharing_weight(model, module)


class _EmbeddingAttack:
    """What the embedding-space attacks (:class:`PGD`, :class:`FGM`, :class:`FreeLB`) share: the modules attacked and
    the ascent's radius, step size and number of steps."""

    def __init__(self, model: nn.Module, target: str | None, epsilon: float, alpha: float, steps: int):
        self.model = model
        self.module, self.modules = embedding_modules(model, target)
        self.epsilon = float(epsilon)
        self.alpha = float(alpha)
        self.steps = int(steps)

    def _not_called(self) -> NoReturn:
        raise RuntimeError(
            f"loss_fn did not call the attacked module ({type(self.module).__name__}); name the embedding module "
            "the forward uses with target= (adv_target)"
        )


class PGD(_EmbeddingAttack):
    """Projected gradient descent in embedding space: K ascent steps of size ``alpha`` inside an ``epsilon`` ball.

    Madry et al. 2018, https://arxiv.org/abs/1706.06083 (for BERT fine-tuning, Zhu et al. 2020,
    https://arxiv.org/abs/1909.11764). With ``norm="global"`` an update equals the classic recipe that perturbs the
    word-embedding weight (for untied embeddings): step ``k`` adds ``alpha * g_k / ||g_k||`` to the perturbation and
    projects it back onto the ball, ``g_0`` being the clean gradient; the parameters' gradient is the clean one plus
    the one of the last, adversarial pass. Passes: ``steps + 1`` forwards and backwards; the ``steps - 1``
    intermediate backwards compute only the gradient with respect to the perturbation.

    The perturbation is added to the output of ``target`` (default ``model.get_input_embeddings()``) by a forward
    hook that exists only during :meth:`step`; the hook reads tensors computed before the forward, keyed by device,
    so it is safe with ``nn.DataParallel`` replicas. Every embedding module that looks up the same weight (an
    encoder's and a decoder's ``embed_tokens`` tied to ``shared``) is perturbed at each call, as the weight would be;
    an output projection tied to it is not. "global" equals the weight-space recipe when the module's output is the
    looked-up row itself (``nn.Embedding``); for scaled embeddings ``epsilon`` is measured on the scaled output.

    Args:
        model (`nn.Module`): the model (unwrapped: DDP / DataParallel wrappers go to ``loss_fn`` instead).
        epsilon (`float`, defaults to 1.0): radius of the ball the perturbation is projected onto.
        alpha (`float`, defaults to 0.3): size of one ascent step.
        steps (`int`, defaults to 3): number of ascent steps K.
        norm (`str`, defaults to "global"): the set each step is normalised over: "global" (the whole batch, as
            the weight-space recipe), "example" (each sequence, Miyato et al. 2017) or "token" (each position).
        target (`str`, *optional*): the name (or unique name suffix) of the module to attack, e.g.
            ``"word_embeddings"``.

    Example::

        pgd = PGD(model, epsilon=1.0, alpha=0.3, steps=3)
        for batch in loader:
            clean_loss, adv_loss = pgd.step(lambda: model(**batch).loss)
            optimizer.step()
            optimizer.zero_grad()
    """

    def __init__(
        self,
        model: nn.Module,
        epsilon: float = 1.0,
        alpha: float = 0.3,
        steps: int = 3,
        norm: str = "global",
        target: str | None = None,
    ):
        validate_attack(epsilon, alpha, steps, norm)
        _EmbeddingAttack.__init__(self, model, target, epsilon, alpha, steps)
        self.norm = norm
        self._mode: str | None = None
        # Set for the last adversarial pass: the modules whose weight gradient goes through _SparseWeightGrad.
        self._sparse: set[nn.Module] = set()
        # Written by the hook, one key per device: each DataParallel replica thread only touches its own entry.
        self._captured: dict[torch.device, list[tuple[torch.Tensor | None, torch.Tensor]]] = {}
        self._cursor: dict[torch.device, int] = {}
        # Read by the hook; computed on the calling thread before each forward.
        self._delta: dict[torch.device, list[torch.Tensor]] = {}

    # ---- The hook --------------------------------------------------------------------------------------------------

    def _hook(self, module: nn.Module, args: tuple, output: torch.Tensor):
        if not torch.is_grad_enabled():
            # A forward without autograd (scheduled sampling's pass 1) takes no part in the loss's gradient: it is
            # neither captured nor perturbed, so it may run in some passes and not in others.
            return None
        if self._mode == "capture":
            if output.requires_grad:
                output.retain_grad()
            else:  # frozen embedding: its output is a leaf, so it can be asked for a gradient directly
                output.requires_grad_()
            self._captured.setdefault(output.device, []).append((_lookup_ids(args, output), output))
            return None
        if self._mode == "perturb":
            k = self._cursor.get(output.device, 0)
            self._cursor[output.device] = k + 1
            deltas = self._delta.get(output.device, [])
            if k >= len(deltas) or deltas[k].shape != output.shape:
                raise RuntimeError(
                    "the embedding module was called differently in the adversarial pass than in the clean pass; "
                    "loss_fn must run the same forward each time"
                )
            ids = _lookup_ids(args, output) if module in self._sparse else None
            if ids is not None:
                output = _SparseWeightGrad.apply(module.weight, ids, module.padding_idx)
            return output + deltas[k]
        return None

    # ---- One training step -----------------------------------------------------------------------------------------

    def step(
        self,
        loss_fn: Callable[[], torch.Tensor],
        backward: Callable[[torch.Tensor], None] | None = None,
        *,
        no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the clean and the adversarial passes, accumulating both gradients into the parameters' ``.grad``.

        Args:
            loss_fn: runs the model's forward on the batch and returns the scalar loss; called once per pass.
            backward: backpropagates a loss into the parameters (default ``loss.backward()``, scaled by
                ``grad_scaler`` if given). Pass ``accelerator.backward`` under Accelerate.
            no_sync: returns a context in which a backward does not all-reduce (``model.no_sync`` for DDP,
                ``functools.partial(accelerator.no_sync, model)``). Every pass but the last runs inside it, so a
                step costs one all-reduce, as plain training. With it, a skipped attack still runs one zero-weight
                pass outside it, so that all processes all-reduce the same number of times.
            grad_scaler: fp16 ``GradScaler``; scales the losses of PGD's gradient-only passes (the scale cancels in
                the direction) and, without ``backward``, the backward.

        Returns:
            ``(clean_loss, adv_loss)``, detached. ``adv_loss`` is ``None`` when the attack was skipped because the
            clean gradient of the embedding output was 0, inf or NaN (e.g. an fp16 overflow step, which the scaler
            skips anyway); then only the clean gradient was accumulated.
        """
        backward, no_sync, skipped = _step_passes(backward, grad_scaler, no_sync)
        scale = grad_scaler.scale if grad_scaler is not None else (lambda loss: loss)
        # First among the module's hooks: the others (NEFTune noise) apply on top of the lookup that the attack's last
        # pass replaces by its sparse-gradient one, instead of being dropped with it.
        handles = [module.register_forward_hook(self._hook, prepend=True) for module in self.modules]
        try:
            self._mode = "capture"
            with no_sync():
                clean = loss_fn()
                backward(clean)
            space = self._collect()
            self._mode = None
            delta = self._attack(space, loss_fn, scale, no_sync)
            if delta is None:
                skipped(loss_fn)
                return clean.detach(), None
            self._perturb(space, delta)
            if torch.is_grad_enabled():
                self._sparse = {module for module in self.modules if _sparse_grad_ok(module)}
            adv = loss_fn()
            backward(adv)
            return clean.detach(), adv.detach()
        finally:
            for handle in handles:
                handle.remove()
            self._mode = None
            self._sparse = set()
            self._captured, self._delta, self._cursor = {}, {}, {}

    def _attack(self, space: _Space, loss_fn, scale, no_sync) -> torch.Tensor | None:
        """The perturbation after the ascent steps from zero, each on the gradient at the previous one (their
        passes' gradients reach no parameter); ``None`` when the clean gradient gives no direction (0, inf, NaN)."""
        delta, ok = self._ascend(space, torch.zeros_like(space.clean_grad), space.clean_grad)
        if not ok:
            return None
        for _ in range(self.steps - 1):
            leaf = delta.requires_grad_()
            self._perturb(space, leaf)
            with no_sync():
                (grad,) = torch.autograd.grad(scale(loss_fn()), leaf)
            delta, ok = self._ascend(space, delta.detach(), grad)
            if not ok:  # no ascent direction: the classic recipe would rerun the same pass; stop here
                break
        return delta

    def _collect(self) -> _Space:
        """The clean gradients of the captured embedding outputs, flattened to ``(positions, hidden)`` float32."""
        if not self._captured:
            self._not_called()
        weight = getattr(self.module, "weight", None)
        home = weight.device if torch.is_tensor(weight) else next(iter(self._captured))
        calls, ids, grads, start = [], [], [], 0
        for device in sorted(self._captured, key=str):
            for call_ids, output in self._captured[device]:
                hidden = output.shape[-1]
                n = output.numel() // hidden
                grad = output.grad if output.grad is not None else torch.zeros_like(output)
                grads.append(grad.reshape(n, hidden).to(device=home, dtype=torch.float32))
                ids.append(None if call_ids is None else call_ids.reshape(n).to(home))
                calls.append(_Call(device, output.dtype, output.shape, start, start + n))
                start += n
        all_ids = None if any(i is None for i in ids) else torch.cat(ids)
        padding_idx = getattr(self.module, "padding_idx", None)
        return _Space(calls, all_ids, torch.cat(grads), padding_idx, self.norm)

    def _ascend(self, space: _Space, delta: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """``delta + alpha * grad / ||grad||`` projected onto the ball; False when the norm is 0, inf or NaN."""
        grad = grad.float()
        norms, total = space.row_norms(grad)
        if not (torch.isfinite(total) and total > 0):
            return delta, False
        delta = delta + grad * torch.where(norms > 0, self.alpha / norms, 0.0).unsqueeze(-1)
        if self.steps > 1 or self.alpha > self.epsilon:
            norms, _ = space.row_norms(delta)
            delta = delta * torch.where(norms > self.epsilon, self.epsilon / norms, 1.0).unsqueeze(-1)
        return delta, True

    def _perturb(self, space: _Space, delta: torch.Tensor) -> None:
        """Arm the hook to add ``delta`` (mapped to each call's output) in the next forward."""
        self._delta = space.to_outputs(delta)
        self._cursor = {}
        self._mode = "perturb"


class FGM(PGD):
    """Fast gradient method in embedding space: one step ``r = epsilon * g / ||g||`` from the clean gradient.

    Miyato et al. 2017, https://arxiv.org/abs/1605.07725 (and Goodfellow et al. 2015,
    https://arxiv.org/abs/1412.6572). With ``norm="global"`` the update equals the classic recipe that perturbs the
    word-embedding weight (for untied embeddings). Two forwards and backwards per step. See :class:`PGD` for
    :meth:`~PGD.step` and the hook.

    Args:
        model (`nn.Module`): the model (unwrapped).
        epsilon (`float`, defaults to 1.0): the perturbation's norm.
        norm (`str`, defaults to "global"): "global", "example" or "token" (see :class:`PGD`).
        target (`str`, *optional*): the name (or unique name suffix) of the module to attack.

    Example::

        fgm = FGM(model, epsilon=1.0)
        clean_loss, adv_loss = fgm.step(lambda: model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()
    """

    def __init__(self, model: nn.Module, epsilon: float = 1.0, norm: str = "global", target: str | None = None):
        super().__init__(model, epsilon=epsilon, alpha=epsilon, steps=1, norm=norm, target=target)


# --- FreeLB ----------------------------------------------------------------------------------------------------------


def _step_passes(backward, grad_scaler, no_sync) -> tuple[Callable, Callable, Callable]:
    """From the arguments every attack's ``step`` takes (see :meth:`PGD.step`): the backward to run, the context of
    the passes before the last, and what a skipped attack runs with ``loss_fn`` (with ``no_sync``, one zero-weight pass
    outside it: the other processes still all-reduce once, so must this one)."""
    if backward is None:
        backward = (lambda loss: grad_scaler.scale(loss).backward()) if grad_scaler else torch.Tensor.backward
    synced = no_sync is not None

    def skipped(loss_fn: Callable[[], torch.Tensor]) -> None:
        if synced:
            backward(loss_fn() * 0.0)

    return backward, no_sync or contextlib.nullcontext, skipped


def _per_example(t: torch.Tensor) -> torch.Tensor:
    """``(examples, rest...)`` viewed as ``(examples, -1)``: one row per example of an embedding call."""
    return t.reshape(t.shape[0], -1)


class FreeLB(_EmbeddingAttack):
    """FreeLB: K ascent steps in embedding space whose parameter gradients are all kept (averaged over the K passes).

    Zhu et al. 2020, "FreeLB: Enhanced Adversarial Training for Natural Language Understanding",
    https://arxiv.org/abs/1909.11764, Algorithm 1 as the official code runs it. Per micro-batch:

    - ``delta_0`` is uniform in ``[-m, m]`` at the positions the attention mask keeps (0 elsewhere), with
      ``m = init_mag / sqrt(length * hidden)`` per example (``length``: the example's kept positions); ``init_mag=0``
      starts at zero;
    - pass ``k = 0 .. K-1`` runs the model with ``delta_k`` added to the embedding output and backpropagates
      ``loss / K`` into the parameters, so their gradient is the mean over the K passes;
    - ``delta_{k+1} = delta_k + alpha * g_k / ||g_k||`` (``g_k`` the gradient at ``delta_k``, the norm per example),
      then projected per example onto the ball of radius ``epsilon`` (``epsilon=0``: no projection);
    - with ``clean_pass`` one clean pass adds its gradient on top (the official code has none; FreeLB#10 reports
      SST-2 91.86 without it, 93.46 with it). With ``init_mag=0`` pass 0 *is* the clean pass, so the two are one
      pass that backpropagates ``(1 + 1/K) * loss``: K passes per step, not K + 1.

    The perturbation lives on the output of ``target`` (default ``model.get_input_embeddings()``, plus every
    embedding module looking up the same weight, as for :class:`PGD`), one tensor per call of that module, with the
    norms per example of each call. No parameter gradient is backed up; the passes after the first add their
    word-embedding gradient sparsely (the batch's rows), as :class:`PGD`'s last pass does.

    Args:
        model (`nn.Module`): the model (unwrapped).
        epsilon (`float`, defaults to 0.0): radius of the per-example ball; 0 disables the projection.
        alpha (`float`, defaults to 0.3): size of one ascent step (per example).
        steps (`int`, defaults to 3): K, the number of perturbed passes. With ``init_mag=0`` K >= 2 is needed for
            any perturbation to be used (``delta_0`` is zero).
        init_mag (`float`, defaults to 0.0): magnitude of the random start (official code: ``adv_init_mag``).
        clean_pass (`bool`, defaults to True): add one clean pass's gradient.
        target (`str`, *optional*): the name (or unique name suffix) of the module to attack.

    Example::

        freelb = FreeLB(model, alpha=0.1, steps=3, init_mag=0.1)
        clean_loss, adv_loss = freelb.step(lambda: model(**batch).loss, attention_mask=batch["attention_mask"])
        optimizer.step()
        optimizer.zero_grad()
    """

    def __init__(
        self,
        model: nn.Module,
        epsilon: float = 0.0,
        alpha: float = 0.3,
        steps: int = 3,
        init_mag: float = 0.0,
        clean_pass: bool = True,
        target: str | None = None,
    ):
        validate_attack(epsilon, alpha, steps, "example", epsilon_may_be_zero=True)
        validate_freelb(init_mag)
        _EmbeddingAttack.__init__(self, model, target, epsilon, alpha, steps)
        self.init_mag = float(init_mag)
        self.clean_pass = bool(clean_pass)
        self._active = False
        self._started = False  # pass 0 has run: no new delta may appear
        self._home = torch.device("cpu")  # where the norms are summed
        self._mask: torch.Tensor | None = None
        self._sparse: set[nn.Module] = set()
        # Per device (DataParallel replicas each touch their own entry): the perturbation of each embedding call,
        # and the leaves the current pass added (their .grad is the gradient at delta_k).
        self._deltas: dict[torch.device, list[torch.Tensor]] = {}
        self._leaves: dict[torch.device, list[torch.Tensor]] = {}
        self._cursor: dict[torch.device, int] = {}

    def _hook(self, module: nn.Module, args: tuple, output: torch.Tensor):
        if not self._active:
            return None
        device = output.device
        k = self._cursor.get(device, 0)
        self._cursor[device] = k + 1
        deltas = self._deltas.setdefault(device, [])
        if k == len(deltas) and not self._started:
            deltas.append(self._initial_delta(output))
        if k >= len(deltas) or deltas[k].shape != output.shape:
            raise RuntimeError(
                "the embedding module was called differently in this FreeLB pass than in the first; "
                "loss_fn must run the same forward each time"
            )
        leaf = deltas[k].requires_grad_()
        self._leaves.setdefault(device, []).append(leaf)
        ids = _lookup_ids(args, output) if module in self._sparse else None
        if ids is not None:
            output = _SparseWeightGrad.apply(module.weight, ids, module.padding_idx)
        return output + leaf.to(output.dtype)

    def _initial_delta(self, output: torch.Tensor) -> torch.Tensor:
        """``delta_0`` for one embedding call: zeros, or uniform in [-m, m] under the mask, m per example."""
        delta = torch.zeros(output.shape, dtype=torch.float32, device=output.device)
        if self.init_mag == 0:
            return delta
        mask = self._mask
        if mask is None or tuple(mask.shape) != tuple(output.shape[:-1]):  # e.g. a decoder's call: every position
            mask = torch.ones(output.shape[:-1], device=output.device)
        mask = mask.to(device=output.device, dtype=torch.float32)
        delta.uniform_(-1, 1).mul_(mask.unsqueeze(-1))
        dims = _per_example(mask).sum(1) * output.shape[-1]
        magnitude = torch.where(dims > 0, self.init_mag / dims.clamp(min=1).sqrt(), 0.0)
        return delta.mul_(magnitude.view(-1, *([1] * (delta.dim() - 1))))

    def _ascend(self) -> bool:
        """``delta_{k+1}`` from the gradients of the pass just run; False when one of them is inf or NaN."""
        updated, squares = {}, []
        for device, leaves in self._leaves.items():
            updated[device] = []
            for leaf in leaves:
                grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                norms = _per_example(grad).norm(dim=1)
                squares.append(norms.pow(2).sum().to(self._home))
                step = torch.where(norms > 0, self.alpha / norms, 0.0)
                delta = leaf.detach() + grad * step.view(-1, *([1] * (grad.dim() - 1)))
                if self.epsilon > 0:
                    norms = _per_example(delta).norm(dim=1)
                    shrink = torch.where(norms > self.epsilon, self.epsilon / norms, 1.0)
                    delta = delta * shrink.view(-1, *([1] * (delta.dim() - 1)))
                updated[device].append(delta)
        if not torch.isfinite(torch.stack(squares).sum()):
            return False
        self._deltas = updated
        return True

    def step(
        self,
        loss_fn: Callable[[], torch.Tensor],
        backward: Callable[[torch.Tensor], None] | None = None,
        *,
        no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the (clean and) K perturbed passes, accumulating their gradients into the parameters' ``.grad``.

        Args:
            loss_fn, backward, no_sync, grad_scaler: as for :meth:`PGD.step` (every backward but the last runs
                inside ``no_sync``: one all-reduce per step).
            attention_mask: ``(batch, length)``; where it is 0 the random start is 0 and the length counts only the
                kept positions. Embedding calls of another shape (a decoder's) count every position.

        Returns:
            ``(clean_loss, adv_loss)``, detached: the clean pass's loss (without a clean pass and with a random
            start: the loss at ``delta_0``) and the mean loss of the K perturbed passes. ``adv_loss`` is ``None``
            when the attack stopped because a gradient was inf or NaN (an fp16 overflow step, which the scaler
            skips anyway).
        """
        backward, no_sync, skipped = _step_passes(backward, grad_scaler, no_sync)
        merged = self.clean_pass and self.init_mag == 0
        weight = self.module.weight if isinstance(getattr(self.module, "weight", None), torch.Tensor) else None
        self._home = weight.device if weight is not None else torch.device("cpu")
        self._mask = attention_mask
        self._started = False
        handles = [module.register_forward_hook(self._hook) for module in self.modules]
        clean, losses = None, []
        try:
            if self.clean_pass and not merged:
                with no_sync():
                    clean = loss_fn()
                    backward(clean)
            for k in range(self.steps):
                last = k == self.steps - 1
                weight = 1.0 / self.steps + (1.0 if merged and k == 0 else 0.0)
                losses.append(
                    self._perturbed_pass(loss_fn, backward, weight, contextlib.nullcontext if last else no_sync)
                )
                if not last and not self._ascend():
                    skipped(loss_fn)
                    return (clean if clean is not None else losses[0]).detach(), None
            clean = clean if clean is not None else losses[0]
            return clean.detach(), torch.stack(losses).mean()
        finally:
            for handle in handles:
                handle.remove()
            self._active = False
            self._mask = None
            self._sparse = set()
            self._deltas, self._leaves, self._cursor = {}, {}, {}

    def _perturbed_pass(self, loss_fn, backward, weight: float, no_sync) -> torch.Tensor:
        """One pass at the current perturbation, its loss backpropagated at ``weight`` (the gradient at ``delta`` on
        each leaf, for the next ascent). DDP decides in the forward whether the backward all-reduces: both run inside
        ``no_sync``."""
        self._leaves, self._cursor = {}, {}
        if torch.is_grad_enabled():
            self._sparse = {module for module in self.modules if _sparse_grad_ok(module)}
        with no_sync():
            self._active = True
            try:
                loss = loss_fn()
            finally:
                self._active = False
            self._check_calls()
            self._started = True
            backward(loss * weight)
        return loss.detach()

    def _check_calls(self) -> None:
        if not self._deltas:
            self._not_called()
        if any(self._cursor.get(device, 0) != len(deltas) for device, deltas in self._deltas.items()):
            raise RuntimeError(
                "the embedding module was called differently in this FreeLB pass than in the first; "
                "loss_fn must run the same forward each time"
            )


# --- AWP -------------------------------------------------------------------------------------------------------------

# A ModuleList index among a module's name segments: the numbered transformer layers (`encoder.layer.3`, `layers.0`,
# `h.11`, `block.2`).
_LAYER_INDEX = re.compile(r"(^|\.)\d+(\.|$)")


def awp_parameters(model: nn.Module, target: str | None = None) -> list[tuple[str, nn.Parameter]]:
    """The parameters AWP perturbs: those whose name matches the regular expression ``target`` (``re.search``), or
    by default the weights of the ``nn.Linear`` (and GPT-2 ``Conv1D``) modules inside the numbered transformer
    layers: not the embeddings, norms, biases or the task head. Each shared parameter is listed once."""
    if target is not None:
        pattern = re.compile(target)
        return [(name, p) for name, p in model.named_parameters() if pattern.search(name)]
    linear: tuple[type, ...] = (nn.Linear,)
    try:
        from transformers.pytorch_utils import Conv1D

        linear += (Conv1D,)
    except ImportError:  # transformers is optional for these classes
        pass
    found, seen = [], set()
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, linear) and _LAYER_INDEX.search(name) and isinstance(weight, nn.Parameter):
            if id(weight) not in seen:
                seen.add(id(weight))
                found.append((f"{name}.weight", weight))
    return found


def _store(store: dict, key, grad: torch.Tensor) -> None:
    store[key] = grad


@contextlib.contextmanager
def _sparse_embedding_grads(modules: list[nn.Module]):
    """Within the block, the listed embedding lookups add their weight gradient sparsely (:class:`_SparseWeightGrad`)
    where that is safe: the pass after a clean one, whose dense gradient is already in ``.grad``."""
    chosen = [module for module in modules if _sparse_grad_ok(module)] if torch.is_grad_enabled() else []

    def hook(module, args, output):
        ids = _lookup_ids(args, output)
        return None if ids is None else _SparseWeightGrad.apply(module.weight, ids, module.padding_idx)

    handles = [module.register_forward_hook(hook) for module in chosen]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class AWP:
    """Adversarial weight perturbation: one pass at weights moved up the loss, the update summing both gradients.

    Wu et al. 2020, "Adversarial Weight Perturbation Helps Robust Generalization", https://arxiv.org/abs/2004.05884,
    in the form the Feedback Prize and NBME winning solutions used (TorchBlocks' ``AWP`` without its clamp). After
    the clean forward/backward, each targeted parameter ``w`` whose clean gradient ``g`` (of this micro-batch only,
    not the gradients earlier micro-batches accumulated) is non-zero becomes ``w + gamma * ||w|| * g / ||g||``
    (norms per parameter tensor); one forward/backward runs at those weights; the weights are restored bitwise. The
    parameters' gradient is the sum of the clean and the adversarial ones.

    Only the perturbed weights are backed up (the popular copies back up every weight plus two clamp bounds); the
    adversarial pass adds its word-embedding gradient sparsely, as :class:`PGD` does.

    Args:
        model (`nn.Module`): the model (unwrapped).
        gamma (`float`, defaults to 0.01): the perturbation's size relative to each weight's norm.
        target (`str`, *optional*): a regular expression matched with ``re.search`` against parameter names.
            Default: the weights of the Linear modules of the transformer layers (see :func:`awp_parameters`).

    Example::

        awp = AWP(model, gamma=0.01)
        clean_loss, adv_loss = awp.step(lambda: model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()
    """

    def __init__(self, model: nn.Module, gamma: float = 0.01, target: str | None = None):
        validate_awp(gamma, target)
        self.model = model
        self.gamma = float(gamma)
        # (name, parameter) of the weights it may perturb
        self.targets = [(name, p) for name, p in awp_parameters(model, target) if p.requires_grad]
        if not self.targets:
            what = f"awp_target={target!r}" if target is not None else "the default awp_target (the layers' Linears)"
            raise ValueError(f"{what} matches no trainable parameter of {type(model).__name__}")
        try:
            embedding = model.get_input_embeddings()
        except (AttributeError, NotImplementedError):
            embedding = None
        self._embeddings = _modules_sharing_weight(model, embedding) if isinstance(embedding, nn.Module) else []

    def step(
        self,
        loss_fn: Callable[[], torch.Tensor],
        backward: Callable[[torch.Tensor], None] | None = None,
        *,
        no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the clean and the adversarial passes, accumulating both gradients into the parameters' ``.grad``.

        Arguments as for :meth:`PGD.step`. Returns ``(clean_loss, adv_loss)``, detached; ``adv_loss`` is ``None``
        when no weight was perturbed because the targeted gradients were all 0, or one was inf or NaN (an fp16
        overflow step, which the scaler skips anyway).
        """
        backward, no_sync, skipped = _step_passes(backward, grad_scaler, no_sync)
        params = [p for _, p in self.targets]
        # `.grad` may hold earlier micro-batches' gradients: catch this micro-batch's on its way in. Only for those
        # (holding the incoming gradient of a parameter with no `.grad` yet would make autograd copy it).
        incoming: dict[int, torch.Tensor] = {}
        held = {id(p) for p in params if p.grad is not None}
        handles = [p.register_hook(functools.partial(_store, incoming, id(p))) for p in params if id(p) in held]
        try:
            with no_sync():
                clean = loss_fn()
                backward(clean)
        finally:
            for handle in handles:
                handle.remove()
        grads = [incoming.get(id(p)) if id(p) in held else p.grad for p in params]
        perturbed, backups = self._perturb(params, grads)
        del incoming, grads
        if not perturbed:
            skipped(loss_fn)
            return clean.detach(), None
        # Inside an enclosing autocast region the low-precision copies of the weights are cached: drop them, or the
        # adversarial forward would multiply by the unperturbed copies (and a later forward by the perturbed ones).
        torch.clear_autocast_cache()
        try:
            with _sparse_embedding_grads(self._embeddings):
                adv = loss_fn()
                backward(adv)
        finally:
            with torch.no_grad():
                for p, backup in zip(perturbed, backups):
                    p.copy_(backup)
            torch.clear_autocast_cache()
        return clean.detach(), adv.detach()

    @torch.no_grad()
    def _perturb(self, params, grads) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
        """Move each parameter with a non-zero gradient; its backup. Nothing when a gradient is inf or NaN."""
        pairs = [(p, g) for p, g in zip(params, grads) if g is not None]
        if not pairs:
            return [], []
        home = pairs[0][1].device
        norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32).to(home) for _, g in pairs])
        flags = torch.cat([torch.isfinite(norms).all().reshape(1), norms > 0]).tolist()  # one device sync
        if not flags[0]:
            return [], []
        perturbed, backups = [], []
        for (p, g), norm, nonzero in zip(pairs, norms, flags[1:]):
            if not nonzero:
                continue
            backups.append(p.detach().clone())
            scale = self.gamma * torch.linalg.vector_norm(p, dtype=torch.float32) / norm.to(p.device)
            p.add_(g * scale.to(p.dtype))  # one parameter's temporary at a time
            perturbed.append(p)
        return perturbed, backups
