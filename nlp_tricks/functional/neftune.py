"""NEFTune noise that several forward passes of one micro-batch share: the adversarial passes reuse the clean one's.

NEFTune (Jain et al. 2023, https://arxiv.org/abs/2310.05914) adds uniform noise of magnitude
``alpha / sqrt(L * d)`` to the word embeddings of every training forward; transformers' Trainer does it with
``--neftune_noise_alpha`` through a forward hook that draws fresh noise at each call. Adversarial training runs
several forwards of one micro-batch (FGM 2, PGD K + 1), and its perturbation is an ascent direction at the clean
pass's embeddings, noise included. Fresh noise in the adversarial pass would add the difference of two draws to the
perturbation: a random vector of norm about ``alpha * sqrt(2 / 3)`` per sequence, as large as a typical
``adv_epsilon`` (1) from ``alpha`` ~ 1 on, and uncorrelated with the attack. With :class:`NEFTuneNoise` the first
pass draws the noise (exactly as upstream's hook: same formula, same random stream) and every later pass of the
micro-batch adds the same tensors, so the passes differ by the adversarial perturbation alone.

No Trainer imports here; :class:`~nlp_tricks.TricksTrainer` uses it when ``neftune_noise_alpha`` and
``adversarial`` are both set.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["NEFTuneNoise", "neftune_noise"]


def neftune_noise(output: torch.Tensor, alpha: float) -> torch.Tensor:
    """Uniform noise in ``[-alpha / sqrt(L * d), alpha / sqrt(L * d)]`` shaped like ``output`` ``(B, L, d)``, drawn as
    ``transformers.integrations.neftune.neftune_post_forward_hook`` draws it (the same values from the same RNG)."""
    magnitude = alpha / torch.sqrt(torch.tensor(output.size(1) * output.size(2)))
    return torch.zeros_like(output).uniform_(-magnitude, magnitude)


class NEFTuneNoise:
    """A forward hook on an embedding module that adds NEFTune noise, drawn in the first pass and then replayed.

    While the context is entered, each forward of ``module`` in training mode adds noise: during the first pass new
    noise is drawn per call; after :meth:`new_pass` the calls add the first pass's tensors, in order. Enter it once
    per micro-batch and call :meth:`new_pass` before every forward pass (or wrap the loss function with
    :meth:`each_pass`).

    Args:
        module (`nn.Module`): the word-embedding module (``model.get_input_embeddings()``).
        alpha (`float`): NEFTune's ``neftune_noise_alpha``.

    Example::

        noise = NEFTuneNoise(model.get_input_embeddings(), alpha=5.0)
        with noise:
            clean_loss, adv_loss = FGM(model).step(noise.each_pass(lambda: model(**batch).loss))
    """

    def __init__(self, module: nn.Module, alpha: float):
        self.module = module
        self.alpha = float(alpha)
        self._noise: list[torch.Tensor] = []
        self._cursor = 0
        self._replaying = False
        self._handle = None

    def __enter__(self) -> NEFTuneNoise:
        self._noise, self._cursor, self._replaying = [], 0, False
        self.attach()
        return self

    def __exit__(self, *exc) -> None:
        self.detach()
        self._noise = []

    def attach(self) -> None:
        """Hook the module, keeping the noise drawn so far (a micro-batch whose passes run at different times, as
        SAM's second pass at the end of the step, attaches again to replay its own draw)."""
        if self._handle is None:
            self._handle = self.module.register_forward_hook(self._hook)

    def detach(self) -> None:
        """Remove the hook; the draw is kept until the context exits."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def new_pass(self) -> None:
        """The next forward is another pass over the same micro-batch: replay the noise from its first call on.
        Before the first pass it does nothing."""
        if self._noise or self._cursor:
            self._replaying = True
        self._cursor = 0

    def each_pass(self, loss_fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """``loss_fn`` preceded by :meth:`new_pass`: one call, one pass."""

        def wrapped() -> torch.Tensor:
            self.new_pass()
            return loss_fn()

        return wrapped

    def _hook(self, module: nn.Module, args: tuple, output: torch.Tensor):
        if not module.training:
            return None
        if not torch.is_grad_enabled():
            # A forward outside the loss's graph (scheduled sampling's pass 1, which runs in the first pass only):
            # noisy as under upstream's hook, but neither recorded nor replayed, so the passes stay aligned.
            return output + neftune_noise(output, self.alpha)
        if not self._replaying:
            self._noise.append(neftune_noise(output, self.alpha))
        elif self._cursor >= len(self._noise) or self._noise[self._cursor].shape != output.shape:
            raise RuntimeError(
                "the embedding module was called differently in this pass than in the first pass of the micro-batch; "
                "the passes must run the same forward"
            )
        noise = self._noise[self._cursor]
        self._cursor += 1
        return output + noise
